"""``ProjectConfiguration``: automatically named checkpoints, ``total_limit``, ``iteration``,
in a real two-rank launch, as Accelerate names them."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from nblaunch import Accelerator, notebook_launcher
from nblaunch.utils import ProjectConfiguration


def _prepared(accelerator: Accelerator) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = accelerator.prepare(model, optimizer)
    return accelerator.unwrap_model(model)


def _save_three_then_resume(project: str, config_class: str) -> dict:
    if config_class == "accelerate":
        from accelerate.utils import ProjectConfiguration as Config
    else:
        Config = ProjectConfiguration
    config = Config(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config)
    model = _prepared(accelerator)
    saved = []
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        saved.append(accelerator.save_state())
    weight_at_last_save = model.weight.detach().clone()

    # A new run of the same project: load_state() finds the latest, the next save follows it.
    resumed = Accelerator(project_config=Config(project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
    model = _prepared(resumed)
    resumed.load_state()
    loaded_equal = torch.equal(model.weight, weight_at_last_save)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after_resume = resumed.save_state("ignored_dir")
    return {"saved": saved, "loaded_equal": loaded_equal, "after_resume": after_resume,
            "iteration": resumed.save_iteration, "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("config_class", ["nblaunch", "accelerate"])
def test_automatic_checkpoint_naming_keeps_the_last_total_limit(tmp_path, config_class):
    if config_class == "accelerate":
        pytest.importorskip("accelerate")
    project = str(tmp_path / "run")
    results = notebook_launcher(_save_three_then_resume, args=(project, config_class), num_processes=2, cpu=True,
                                display="none")
    checkpoints = os.path.join(project, "checkpoints")
    for result in results:
        assert result["saved"] == [os.path.join(checkpoints, f"checkpoint_{n}") for n in range(3)]
        assert result["loaded_equal"] is True
        assert result["after_resume"] == os.path.join(checkpoints, "checkpoint_3")
        assert result["iteration"] == 4
        assert any("not ignored_dir" in message for message in result["warnings"])
    assert not os.path.exists(os.path.join(project, "ignored_dir"))
    # total_limit=2: the two newest are kept.
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_2", "checkpoint_3"]
    removed = [message for message in results[0]["warnings"] if "total_limit=2: removing" in message]
    assert removed and removed[0].endswith("checkpoint_1")  # room made for checkpoint_3


def test_naming_refuses_to_overwrite_and_explains(tmp_path):
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True))
    _prepared(accelerator)
    accelerator.save_state()
    accelerator.project_configuration.iteration = 0
    with pytest.raises(ValueError, match="checkpoint_0 exists, and this save would be checkpoint_0: call "
                                         "load_state\\(\\) first .*iteration = 1"):
        accelerator.save_state()
    with pytest.raises(ValueError, match="total_limit must be at least 1"):
        ProjectConfiguration(total_limit=0)
    empty = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path / "new"),
                                                            automatic_checkpoint_naming=True))
    with pytest.raises(FileNotFoundError, match="no checkpoint to load in .*new/checkpoints"):
        empty.load_state()
    with pytest.raises(ValueError, match="automatic_checkpoint_naming needs a project directory"):
        Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True)).save_state()


def test_project_dir_and_logging_dir_follow_accelerates_rules(tmp_path):
    accelerator = Accelerator(project_dir=str(tmp_path))
    assert accelerator.project_dir == accelerator.logging_dir == str(tmp_path)
    config = ProjectConfiguration(logging_dir=str(tmp_path / "logs"))
    accelerator = Accelerator(project_config=config, project_dir=str(tmp_path))
    assert (accelerator.project_dir, accelerator.logging_dir) == (str(tmp_path), str(tmp_path / "logs"))
    assert accelerator.project_configuration is config  # the user's own object, as in Accelerate


def test_folders_of_ones_own_among_the_checkpoints_are_never_counted_pruned_or_loaded(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for own in ("checkpoint_best", "best_epoch_97", "v2_baseline"):
        (checkpoints / own).mkdir(parents=True)
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True, total_limit=1))
    model = _prepared(accelerator)
    accelerator.save_state()
    with torch.no_grad():
        model.weight.add_(1.0)
    saved = model.weight.detach().clone()
    with pytest.warns(UserWarning, match="removing .*checkpoint_0"):
        accelerator.save_state()
    assert sorted(os.listdir(checkpoints)) == ["best_epoch_97", "checkpoint_1", "checkpoint_best", "v2_baseline"]
    resumed = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                              automatic_checkpoint_naming=True))
    model = _prepared(resumed)
    resumed.load_state()
    assert torch.equal(model.weight, saved) and resumed.save_iteration == 2
    fresh = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                            automatic_checkpoint_naming=True))
    _prepared(fresh)
    with pytest.raises(ValueError, match="checkpoint_1 exists, and this save would be checkpoint_0"):
        fresh.save_state()  # a new run that did not load: its save would hide below the newest


class FailingSave:
    """Checkpointed with the model; gathering its state fails (a full disk, a kernel dying)."""

    def state_dict(self):
        raise OSError("No space left on device")

    def load_state_dict(self, state):
        pass


def test_a_save_cut_short_under_total_limit_keeps_the_last_whole_checkpoint(tmp_path):
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True, total_limit=1))
    _prepared(accelerator)
    accelerator.save_state()
    accelerator.register_for_checkpointing(FailingSave())
    with pytest.raises(OSError, match="No space left"):
        accelerator.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]  # 0 is still whole
    resumed = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                              automatic_checkpoint_naming=True))
    _prepared(resumed)
    with pytest.raises(Exception, match="checkpoint_1 is incomplete"):
        resumed.load_state()  # the newest, cut short, is refused ...
    resumed.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))  # ... and the whole one loads


def test_loading_an_older_checkpoint_numbers_the_next_save_after_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True))
    _prepared(accelerator)
    for _ in range(3):
        accelerator.save_state()
    resumed = Accelerator(project_config=ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True))
    _prepared(resumed)
    resumed.load_state(str(tmp_path / "run" / "checkpoints" / "checkpoint_1"))  # an absolute path, as resume= gives
    assert resumed.save_state() == os.path.join("run", "checkpoints", "checkpoint_3")
