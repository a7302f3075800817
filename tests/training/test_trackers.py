"""``Accelerator(log_with=...)``: every built-in tracker written by the main process of a real
two-rank launch, in its offline or local mode (nothing leaves the machine), and read back
with the backend's own reader; the cell's dashboard keeps its metrics from every rank."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sqlite3
import struct
import sys

import pytest
import torch

from nblaunch import Accelerator, notebook_launcher
from nblaunch.events import Metrics
from nblaunch.tracking import GeneralTracker, LoggerType

STEPS = 4


def _offline(root: str) -> None:
    """Every backend local, under ``root``: set in the rank, so the test's own environment is untouched."""
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=os.path.join(root, "wandb"), WANDB_SILENT="true",
                      TRACKIO_DIR=os.path.join(root, "trackio"),
                      MLFLOW_TRACKING_URI="sqlite:///" + os.path.join(root, "mlflow.db"))


def _train_and_log(root: str, log_with) -> dict:
    _offline(root)
    accelerator = Accelerator(log_with=log_with, project_dir=os.path.join(root, "project"))
    accelerator.init_trackers("digits", config={"lr": 0.1, "optimizer": "SGD"})
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(STEPS):
        x = torch.full((4, 3), float(accelerator.process_index + step))
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), "note": f"step {step}"}, step=step)
        losses.append(loss.item())
    # Every rank may ask for a tracker: on rank 1 it does nothing.
    accelerator.get_tracker("tensorboard").log({"extra": 1.0}, step=STEPS)
    unwrapped = type(accelerator.get_tracker("wandb", unwrap=True)).__name__
    accelerator.end_training()
    return {"losses": losses, "unwrapped": unwrapped}


def _wandb_records(root: str) -> tuple[dict, list[dict]]:
    """The config and history of the one offline W&B run under ``root``, read from its .wandb
    file (LevelDB log blocks of W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(root, "wandb", "wandb", "offline-run-*", "run-*.wandb"))
    data, block, position, pending, records = open(path, "rb").read(), 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        position += 7
        pending += data[position:position + length]
        position += length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(pending)
            pending = b""
    def key(item) -> str:  # newer W&B writes nested_key, older key
        return item.key or "/".join(item.nested_key)

    config, history = {}, []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "config":
            config.update({key(item): json.loads(item.value_json) for item in record.config.update})
        elif record.WhichOneof("record_type") == "history":
            history.append({key(item): json.loads(item.value_json) for item in record.history.item})
    return config, history


@pytest.mark.slow
def test_every_built_in_tracker_gets_the_main_process_metrics(tmp_path, recorder):
    # Not imported here: trackio reads TRACKIO_DIR when imported, and the ranks are forked from this process.
    missing = [name for name in ("tensorboard", "wandb", "mlflow", "trackio") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    assert "trackio" not in sys.modules, "trackio was imported by an earlier test: the ranks would write to ~/.cache"
    root = str(tmp_path)
    first, second = notebook_launcher(_train_and_log, args=(root, "all"), num_processes=2, cpu=True,
                                      display=recorder)
    expected = pytest.approx(first["losses"], rel=1e-6)
    assert first["unwrapped"] == "Run" and second["unwrapped"] == "GeneralTracker"

    # The cell's chart: every rank's loss, trackers or not.
    drawn = {rank: [m.values["loss"] for m in recorder.of(Metrics) if m.rank == rank] for rank in (0, 1)}
    assert drawn[0] == expected and drawn[1] == pytest.approx(second["losses"], rel=1e-6)

    # TensorBoard: one run (rank 0's), its scalars, text and the extra value logged on rank 0 only.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # (The hparams are an event file of their own, written by the same process.)
    writers = {path.split(".")[-2] for path in glob.glob(os.path.join(root, "project", "digits", "events.out.*"))}
    assert len(writers) == 1, writers
    events = EventAccumulator(os.path.join(root, "project", "digits")).Reload()
    assert [e.value for e in events.Scalars("loss")] == expected
    assert [e.step for e in events.Scalars("loss")] == list(range(STEPS))
    assert [e.value for e in events.Scalars("extra")] == [1.0]
    assert "note/text_summary" in events.Tags()["tensors"]

    # W&B, offline: the config and every step.
    config, history = _wandb_records(root)
    assert config["lr"] == 0.1 and config["optimizer"] == "SGD"
    assert [row["loss"] for row in history if "loss" in row] == expected
    assert [row["_step"] for row in history if "loss" in row] == list(range(STEPS))

    # MLflow: one run in the experiment named after the project, its parameters and metric history.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(root, "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.data.params == {"lr": "0.1", "optimizer": "SGD"}
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.value for m in history] == expected and run.info.status == "FINISHED"

    # trackio: its local database for the project.
    database = sqlite3.connect(os.path.join(root, "trackio", "digits.db"))
    rows = [json.loads(row[0]) for row in database.execute("SELECT metrics FROM metrics ORDER BY step")]
    assert [row["loss"] for row in rows if "loss" in row] == expected


class _Lines(GeneralTracker):
    """A tracker of one's own: writes each logged value as a line of a file."""

    name = "lines"
    requires_logging_directory = False

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self):
        return self.path

    def start(self) -> None:
        with open(self.path, "w") as file:
            file.write(f"start rank {os.environ.get('RANK', '0')}\n")

    def log(self, values, step=None, **kwargs) -> None:
        with open(self.path, "a") as file:
            file.write(f"{step} {values['loss']:.4f} {kwargs}\n")

    def finish(self) -> None:
        with open(self.path, "a") as file:
            file.write("finish\n")


def _custom_and_accelerates(root: str) -> str | None:
    from accelerate.tracking import TensorBoardTracker as AcceleratesTensorBoard

    accelerator = Accelerator(log_with=[_Lines(os.path.join(root, "lines.txt")),
                                        AcceleratesTensorBoard("theirs", os.path.join(root, "tb"))])
    accelerator.init_trackers("ignored by tracker objects")
    for step in range(2):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step, log_kwargs={"lines": {"tag": "x"}})
    path = accelerator.get_tracker("lines", unwrap=True)
    accelerator.end_training()
    return path


def test_tracker_objects_of_ones_own_and_accelerates(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    paths = notebook_launcher(_custom_and_accelerates, args=(str(tmp_path),), num_processes=2, cpu=True,
                              display="none")
    assert paths[0] == str(tmp_path / "lines.txt")
    assert (tmp_path / "lines.txt").read_text().splitlines() == [
        "start rank 0", "0 1.0000 {'tag': 'x'}", "1 0.5000 {'tag': 'x'}", "finish"]
    assert len(glob.glob(str(tmp_path / "tb" / "theirs" / "events.out.tfevents.*"))) == 1


def test_log_with_is_checked_when_the_accelerator_is_made(tmp_path, monkeypatch):
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    with pytest.raises(ValueError, match="unknown tracker 'tensorbaord'"):
        Accelerator(log_with="tensorbaord")
    with pytest.raises(ValueError, match=r"accelerate.tracking.AimTracker"):
        Accelerator(log_with="aim")
    with pytest.raises(ValueError, match="writes files: give Accelerator\\(project_dir=...\\)"):
        Accelerator(log_with=LoggerType.TENSORBOARD)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ImportError, match="needs the mlflow package, which is not installed: pip install mlflow"):
        Accelerator(log_with=["tensorboard", "mlflow"], project_dir=str(tmp_path))
    assert "mlflow" not in Accelerator(log_with="all", project_dir=str(tmp_path)).log_with
    accelerate_names = pytest.importorskip("accelerate.utils")
    assert Accelerator(log_with=[accelerate_names.LoggerType.TENSORBOARD, "tensorboard"],
                       project_dir=str(tmp_path)).log_with == ["tensorboard"]


def test_a_tracker_that_fails_to_start_closes_those_already_open(tmp_path):
    class Broken(_Lines):
        name = "broken"

        def start(self):
            raise RuntimeError("no server")

    good = _Lines(str(tmp_path / "good.txt"))
    accelerator = Accelerator(log_with=[good, Broken(str(tmp_path / "bad.txt"))])
    with pytest.raises(RuntimeError, match="no server"):
        accelerator.init_trackers("p")
    assert (tmp_path / "good.txt").read_text().splitlines() == ["start rank 0", "finish"]
    assert accelerator.trackers == []
    assert accelerator.get_tracker("good").log({"loss": 1.0}) is None  # a tracker that does nothing
