"""The contract between launcher and ranks (``nblaunch/contract``), and the one reader of
``cluster=``: each environment variable name is written once; every door accepts and refuses the
same ``mixed_precision`` words; a rank's failure crosses as a typed record; only the cluster factory
branches on a cluster's name."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest

from nblaunch import LaunchConfigError, RankFailedError, WarmRanks, notebook_launcher
from nblaunch.__main__ import build_parser
from nblaunch.cli.accelerate_config import ConfigError, read_config
from nblaunch.contract import variables
from nblaunch.contract.failure import Phase, RankFailure, RemoteError
from nblaunch.contract.precision import fast_precision
from nblaunch.training import Accelerator, AcceleratorState, reset_process_state

PACKAGE = Path(__file__).resolve().parent.parent / "nblaunch"
CONTRACT_NAMES = {value for name, value in vars(variables).items() if name.isupper() and isinstance(value, str)}
CONTRACT_NAMES |= set(variables.FSDP_VARIABLES.values())


def string_constants(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_each_environment_variable_name_is_written_once():
    contract = PACKAGE / "contract" / "variables.py"
    spelled_out = [f"{path.relative_to(PACKAGE.parent)}:{line} {value}"
                   for path in PACKAGE.rglob("*.py") if path != contract
                   for value, line in string_constants(path) if value in CONTRACT_NAMES]
    assert not spelled_out, "use nblaunch.contract.variables:\n" + "\n".join(spelled_out)
    written = [value for value, _ in string_constants(contract) if value in CONTRACT_NAMES]
    assert len(written) == len(set(written)), sorted(written)


def test_only_clusters_py_tests_a_clusters_name():
    """``cluster=`` names a cluster; only ``nblaunch/clusters.py`` looks at the name."""
    def tests_cluster(node: ast.AST) -> bool:
        if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                        for op in node.ops):
            return False
        operands = [node.left, *node.comparators]
        return any((isinstance(o, ast.Name) and o.id == "cluster") or (isinstance(o, ast.Attribute) and o.attr == "cluster")
                   or (isinstance(o, ast.Constant) and o.value == "ray") for o in operands)

    factory = PACKAGE / "clusters.py"
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for path in PACKAGE.rglob("*.py") if path != factory
             for node in ast.walk(ast.parse(path.read_text())) if tests_cluster(node)]
    assert not found, "ask the cluster (nblaunch.clusters) instead: " + ", ".join(found)


# Every door's answer for each word: the canonical word, or "refused" (not a word of the vocabulary).
# "auto" is a word everywhere; where the device is known (a launch's ranks, an Accelerator) it is
# what the device computes fast, here the CPU's.
WORDS = {
    "no": "no", "NO": "no", "fp16": "fp16", "FP16": "fp16", "bf16": "bf16", " Bf16 ": "bf16", "fp8": "fp8",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp32": "no", "none": "no", "auto": "auto", "AUTO": "auto",
    "fp4": "refused", "int8": "refused", "bfloat": "refused", "float32": "refused", "automatic": "refused", "": "refused",
}
ON_THIS_CPU = fast_precision("cpu")


def rank_precision() -> tuple[str, str]:
    return os.environ["NBLAUNCH_MIXED_PRECISION"], os.environ["ACCELERATE_MIXED_PRECISION"]


def rank_accelerator_precision() -> str:
    accelerator = Accelerator()
    # A rank that returns while its peer still connects its gloo group resets that connection.
    accelerator.wait_for_everyone()
    return accelerator.mixed_precision


def notebook_launchers_answer(word: str) -> str:
    try:
        results = notebook_launcher(rank_precision, num_processes=1, mixed_precision=word, display="none")
    except LaunchConfigError as error:
        if "mixed_precision must be one of" in str(error):
            return "refused"
        assert word.strip().lower() == "fp8" and "needs CUDA GPUs" in str(error)  # a word, not runnable here
        return "fp8"
    (ours, accelerates), = results
    assert ours == accelerates
    return ours


def clis_answer(word: str) -> str:
    try:
        return build_parser().parse_args(["launch", "--mixed-precision", word, "train.py"]).mixed_precision
    except SystemExit:
        return "refused"


def accelerators_answer(word: str) -> str:
    try:
        return Accelerator(mixed_precision=word, cpu=True).mixed_precision
    except NotImplementedError as error:  # a word of the vocabulary that nblaunch's Accelerator cannot run
        assert "'fp8' is not supported by nblaunch's Accelerator" in str(error)
        return "fp8"
    except ValueError as error:
        assert "mixed_precision must be one of" in str(error)
        return "refused"
    finally:
        reset_process_state()


def warm_ranks_answer(word: str) -> str:
    try:
        pool = WarmRanks(num_processes=1, mixed_precision=word, display="none")  # starts nothing yet
    except LaunchConfigError as error:
        return "refused" if "mixed_precision must be one of" in str(error) else "fp8"
    return pool.request.mixed_precision


def config_files_answer(word: str, tmp_path: Path) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"mixed_precision: '{word}'\n")
    try:
        return read_config(str(path)).options["mixed_precision"]
    except ConfigError:
        return "refused"


def states_answer(word: str, monkeypatch) -> str:
    monkeypatch.setenv("NBLAUNCH_MIXED_PRECISION", word)
    try:
        return AcceleratorState().mixed_precision
    except ValueError:
        return "refused"
    finally:
        reset_process_state()


@pytest.mark.parametrize("word", list(WORDS))
def test_every_door_accepts_and_refuses_the_same_mixed_precision_words(word, tmp_path, monkeypatch):
    expected = WORDS[word]
    decided = ON_THIS_CPU if expected == "auto" else expected  # by the doors that know the device
    answers = {
        "notebook_launcher": notebook_launchers_answer(word),
        "nblaunch launch": clis_answer(word),
        "Accelerator": accelerators_answer(word),
        "WarmRanks": warm_ranks_answer(word),
    }
    if word:  # an empty variable, or config value, is one not given
        answers["Accelerate config file"] = config_files_answer(word, tmp_path)
        answers["AcceleratorState (the rank's environment)"] = states_answer(word, monkeypatch)
    knows_the_device = ("notebook_launcher", "Accelerator", "AcceleratorState (the rank's environment)")
    assert answers == {door: decided if door in knows_the_device else expected for door in answers}


def test_a_launchers_word_reaches_every_ranks_accelerator_in_its_one_form():
    assert notebook_launcher(rank_accelerator_precision, num_processes=2, mixed_precision="BFloat16",
                             display="none") == ["bf16", "bf16"]


def test_a_failure_record_crosses_with_its_exception_or_a_stand_in():
    failure = RankFailure(rank=1, reason="ValueError: boom", exception=ValueError("boom"), traceback="Traceback ...\n",
                          type_name="builtins.ValueError")
    crossed = pickle.loads(pickle.dumps(failure))
    assert isinstance(crossed.exception, ValueError) and crossed.exception.args == ("boom",)
    assert "Traceback" in str(crossed.exception.__cause__)
    assert (crossed.rank, crossed.phase, crossed.complete) == (1, Phase.RUNNING, True)

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("not today")

    lost = pickle.loads(pickle.dumps(RankFailure(0, "Unpicklable: x", exception=Unpicklable("x"),
                                                 type_name="tests.Unpicklable")))
    assert isinstance(lost.exception, RemoteError) and lost.exception.type_name == "Unpicklable"
    ended = pickle.loads(pickle.dumps(RankFailure(0, "killed by SIGKILL", phase=Phase.ENDED)))
    assert ended.exception is None  # the launcher's own finding: no exception to stand in for


def test_the_root_cause_is_chosen_in_one_place_whatever_the_order():
    own = RankFailure(2, "ValueError: bad batch", failed_at=2.0)
    peer_a = RankFailure(0, "DistBackendError: Connection closed by peer", collateral=True, failed_at=1.0)
    peer_b = RankFailure(1, "DistBackendError: Connection closed by peer", collateral=True, failed_at=1.5)
    error = RankFailedError.blaming([peer_a, peer_b, own], {}, shown_failing=[1, 0, 2], finished=[])
    assert [f.rank for f in error.failures] == [2, 1, 0]  # its own error first, then as the cell showed them
    lonely = RankFailure(0, "DistBackendError: Connection closed by peer", collateral=True,
                         traceback='  File "x/distributed_c10d.py", line 9, in all_reduce\n')
    left = RankFailedError.blaming([lonely], {}, shown_failing=[0], finished=[1])
    assert left.root_cause.reason.startswith("still in all_reduce() when rank 1 finished and left")
