"""``nblaunch.utils``' helpers give the answers ``accelerate.utils``' give for the same input
(where Accelerate is installed), and say what to do when the input is wrong."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import nblaunch.utils as ours

theirs = pytest.importorskip("accelerate.utils")

Pair = collections.namedtuple("Pair", "x y")


def _nested():
    return {"x": torch.arange(6.0).reshape(3, 2).half(), "rest": [Pair(torch.ones(3, dtype=torch.bfloat16),
                                                                  torch.zeros(3, 1, dtype=torch.long))]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name, args", [
    ("find_batch_size", (_nested(),)),
    ("ignorant_find_batch_size", ([],)),
    ("listify", (_nested(),)),
    ("convert_to_fp32", (_nested(),)),
    ("slice_tensors", (_nested(), slice(0, 2))),
    ("pad_input_tensors", (_nested(), 3, 2)),
    ("is_namedtuple", (Pair(1, 2),)),
    ("honor_type", (Pair(1, 2), [3, 4])),
    ("str_to_bool", ("On",)),
    ("merge_dicts", ({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}})),
    ("convert_bytes", (3_500_000,)),
    ("convert_file_size_to_int", ("500MiB",)),
    ("convert_file_size_to_int", ("5GB",)),
    ("dtype_byte_size", (torch.bfloat16,)),
    ("is_torch_version", (">=", "2.0")),
    ("compare_versions", ("torch", "<", "99")),
])
def test_same_answer_as_accelerate(name, args):
    assert _same(getattr(ours, name)(*args), getattr(theirs, name)(*args))


def test_structures_rebuild_and_tied_parameters_match():
    structure = ours.get_data_structure(_nested())
    assert _same(ours.get_data_structure(ours.initialize_tensors(structure)), structure)
    assert ours.initialize_tensors(structure)["x"].shape == (3, 2)

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    assert ours.find_tied_parameters(model) == theirs.find_tied_parameters(model) == [["0.weight", "1.weight"]]
    assert ours.compute_module_sizes(model) == dict(theirs.compute_module_sizes(model))
    assert ours.get_module_children_bottom_up(model, True) == theirs.get_module_children_bottom_up(model, True)
    model[1].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # the tie broken, as hooks do
    ours.retie_parameters(model, [["0.weight", "1.weight"]])
    assert model[1].weight is model[0].weight
    assert ours.id_tensor_storage(model[0].weight) == ours.id_tensor_storage(model[1].weight)


def test_compiled_and_parallel_models_are_unwrapped_as_accelerate_does(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch 2.9's compile would set it for good
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert ours.is_compiled_module(compiled) and not ours.is_compiled_module(model)
    assert ours.has_compiled_regions(torch.nn.Sequential(compiled))
    assert ours.extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert ours.extract_model_from_parallel(compiled) is compiled
    assert ours.model_has_dtensor(model) is False


def test_environment_helpers_put_everything_back(monkeypatch):
    monkeypatch.delenv("NBLAUNCH_TEST_FLAG", raising=False)
    with ours.patch_environment(nblaunch_test_flag="yes"):
        assert ours.parse_flag_from_env("NBLAUNCH_TEST_FLAG") is True
    assert "NBLAUNCH_TEST_FLAG" not in os.environ
    before = dict(os.environ)
    with ours.clear_environment():
        assert os.environ == {}
    assert dict(os.environ) == before
    assert ours.get_int_from_env(["NBLAUNCH_UNSET_A", "NBLAUNCH_UNSET_B"], 7) == 7

    @ours.purge_accelerate_environment
    def sets_a_variable():
        os.environ["ACCELERATE_NBLAUNCH_TEST"] = "1"

    sets_a_variable()
    assert "ACCELERATE_NBLAUNCH_TEST" not in os.environ
    assert ours.convert_dict_to_env_variables({"GOOD": "1"}) == ["GOOD=1\n"]
    with pytest.warns(UserWarning, match="unsafe"):
        assert ours.convert_dict_to_env_variables({"BAD": "<x"}) == []


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="write it like '5GB'"):
        ours.convert_file_size_to_int("five gigs")
    with pytest.raises(ValueError, match="use yes/no"):
        ours.str_to_bool("maybe")
    with pytest.raises(TypeError, match="give tensors"):
        ours.find_batch_size("text")
    with pytest.raises(ValueError, match="operation must be one of"):
        ours.compare_versions("torch", "=>", "2.0")


def test_weights_files_are_read_back(tmp_path):
    weights = {"w": torch.arange(4.0)}
    torch.save(weights, tmp_path / "pytorch_model.bin")
    assert _same(ours.load_state_dict(str(tmp_path / "pytorch_model.bin")), weights)
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file(weights, str(tmp_path / "model.safetensors"))
    assert _same(ours.load_state_dict(str(tmp_path / "model.safetensors")), weights)


def test_load_reads_tensors_and_arrays_and_refuses_code(tmp_path):
    import numpy

    torch.save({"w": torch.ones(2), "rng": numpy.random.get_state(), "x": numpy.float32(1.5)}, tmp_path / "ok.bin")
    loaded = ours.load(tmp_path / "ok.bin")
    assert torch.equal(loaded["w"], torch.ones(2)) and loaded["x"] == 1.5
    torch.save({"code": Pair(1, 2)}, tmp_path / "code.bin")  # a class of its own: not weights
    with pytest.raises(Exception, match="weights_only"):
        ours.load(tmp_path / "code.bin")
    assert ours.load(tmp_path / "code.bin", weights_only=False)["code"] == Pair(1, 2)


def test_write_basic_config_writes_a_file_both_launchers_read(tmp_path):
    from nblaunch.cli.accelerate_config import read_config

    path = str(tmp_path / "accelerate" / "default_config.yaml")
    assert ours.write_basic_config(mixed_precision="bf16", save_location=path) == path
    assert ours.write_basic_config(save_location=path) is False  # there already: left as it is
    assert read_config(path).options["mixed_precision"] == "bf16"
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(path).mixed_precision == "bf16"  # Accelerate reads it too
    with pytest.raises(ValueError, match="mixed_precision must be"):
        ours.write_basic_config(mixed_precision="fp4", save_location=str(tmp_path / "other.json"))
