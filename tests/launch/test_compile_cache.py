"""Where a launch's ranks keep torch.compile's code (README, "Re-running a cell"): one folder per
torch version under ~/.cache/nblaunch/compile ($XDG_CACHE_HOME, or NBLAUNCH_COMPILE_CACHE), the
user's own TORCHINDUCTOR_CACHE_DIR kept, torch's default (which it writes into os.environ) not."""

from __future__ import annotations

import getpass

import torch

from nblaunch.launch.planning.compile_cache import compile_cache_dir, compile_cache_environ, compile_environ

VERSION = f"torch-{torch.__version__}"


def test_the_folder_is_per_torch_version_under_the_users_cache(tmp_path):
    assert compile_cache_dir({"HOME": "/home/ada"}) == f"/home/ada/.cache/nblaunch/compile/{VERSION}"
    assert compile_cache_dir({"HOME": "/home/ada", "XDG_CACHE_HOME": "/c"}) == f"/c/nblaunch/compile/{VERSION}"
    chosen = {"HOME": "/home/ada", "NBLAUNCH_COMPILE_CACHE": str(tmp_path)}
    assert compile_cache_environ(chosen) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / VERSION)}
    assert (tmp_path / VERSION).is_dir()


def test_the_users_own_inductor_folder_is_kept_and_torchs_default_is_not(tmp_path):
    mine = {"NBLAUNCH_COMPILE_CACHE": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": "/data/inductor"}
    assert compile_cache_environ(mine) == {}
    torchs = dict(mine, TORCHINDUCTOR_CACHE_DIR=f"/tmp/torchinductor_{getpass.getuser()}")
    assert compile_cache_environ(torchs) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / VERSION)}


def test_a_folder_that_cannot_be_made_leaves_torchs_default(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert compile_cache_environ({"NBLAUNCH_COMPILE_CACHE": str(blocked)}) == {}


def test_each_rank_gets_its_share_of_compile_workers_unless_the_user_chose(tmp_path):
    from nblaunch.launch.planning.threads import usable_cores

    base = {"NBLAUNCH_COMPILE_CACHE": str(tmp_path)}
    assert compile_environ(2, base)["TORCHINDUCTOR_COMPILE_THREADS"] == str(max(1, usable_cores() // 2))
    assert compile_environ(10_000, base)["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in compile_environ(2, dict(base, TORCHINDUCTOR_COMPILE_THREADS="8"))
