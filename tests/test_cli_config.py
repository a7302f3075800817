"""``nblaunch launch`` reading Hugging Face Accelerate's config files (``--config_file``, or the
default file under ``HF_HOME``), as a terminal user meets it: real files, real
``python -m nblaunch launch`` processes, real ranks on the CPU (gloo). ``HF_HOME`` always points
into the test's own folder: the real user's ``~/.cache`` is never read."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from nblaunch.cli.accelerate_config import ConfigError, read_config
from nblaunch.training.options.fsdp_environment import fsdp_plugin_from_environment

# What every rank's Accelerator was given by the launch.
REPORT = """
    import os
    from nblaunch import Accelerator

    accelerator = Accelerator()
    print(f"world {os.environ['WORLD_SIZE']} precision {accelerator.mixed_precision} "
          f"fsdp {accelerator.fsdp_plugin is not None} gpus {os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
"""

# A model of two Blocks prepared by an Accelerator made without fsdp_plugin, and one step.
SHARDS = """
    import os
    import torch
    from nblaunch import Accelerator

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.linear(x))

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()
    units = [name for name, module in model.named_modules() if type(module).__name__.startswith("FSDP")]
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    print(f"world {os.environ['WORLD_SIZE']} {accelerator.distributed_type} units {units} parameters {kinds}")
"""

CPU_BF16 = """
    compute_environment: LOCAL_MACHINE
    distributed_type: MULTI_CPU
    num_processes: 2
    mixed_precision: bf16
    use_cpu: true
    debug: false
    rdzv_backend: static
    main_training_function: main
"""

FSDP = """
    compute_environment: LOCAL_MACHINE
    distributed_type: FSDP
    num_processes: 2
    use_cpu: true
    mixed_precision: 'no'
    fsdp_config:
      fsdp_version: 2
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_transformer_layer_cls_to_wrap: Block
      fsdp_reshard_after_forward: true
      fsdp_offload_params: false
      fsdp_state_dict_type: SHARDED_STATE_DICT
      fsdp_cpu_ram_efficient_loading: true
      fsdp_sync_module_states: true
"""


def write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def nblaunch(*args, cwd, **environ) -> subprocess.CompletedProcess:
    """``python -m nblaunch launch ...`` in ``cwd``, with Accelerate's default file looked for
    under ``cwd/hf`` (``HF_HOME``) unless ``environ`` says otherwise."""
    env = dict(os.environ, HF_HOME=str(cwd / "hf"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(environ)
    return subprocess.run([sys.executable, "-m", "nblaunch", "launch", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=180)


def rank_lines(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("[rank "))


def test_processes_and_mixed_precision_from_the_file_reach_every_rank(tmp_path):
    write(tmp_path, "report.py", REPORT)
    config = write(tmp_path, "cpu_bf16.yaml", CPU_BF16)
    done = nblaunch("--config_file", config, "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"nblaunch: options from Accelerate's config {config} (flags given here win)"
    assert rank_lines(done.stdout) == [f"[rank {r}] world 2 precision bf16 fsdp False gpus ''" for r in (0, 1)]
    assert done.stderr == ""  # every key of the file is known: no warning


def test_flags_on_the_command_line_win_over_the_file(tmp_path):
    write(tmp_path, "report.py", REPORT)
    config = write(tmp_path, "cpu_bf16.yaml", CPU_BF16)
    done = nblaunch("--config-file", config, "--num_processes", "1", "--mixed_precision", "no", "report.py",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout) == ["[rank 0] world 1 precision no fsdp False gpus ''"]


def test_unknown_keys_are_named_in_one_warning_and_the_launch_goes_on(tmp_path):
    write(tmp_path, "report.py", REPORT)
    config = write(tmp_path, "odd.yaml", textwrap.dedent(CPU_BF16) + textwrap.dedent("""
        use_mps_device: false
        frobnicate: 3
        fsdp_config:
          fsdp_sharding_strategy: FULL_SHARD
          fsdp_frobnicate: true
    """))
    done = nblaunch("--config_file", config, "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"nblaunch launch: warning: {config} has keys nblaunch does not know, "
                                        "ignored: frobnicate, use_mps_device, fsdp_config.fsdp_frobnicate"]
    assert len(rank_lines(done.stdout)) == 2


@pytest.mark.slow
def test_what_nblaunch_does_not_do_is_refused_before_anything_starts(tmp_path):
    write(tmp_path, "report.py", REPORT)
    cases = {
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  frobnicate: 1\n":
            "deepspeed_config.frobnicate is not a DeepSpeed setting nblaunch knows",
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_optimizer_device: disk\n":
            "offload_optimizer_device='disk'): give one of ('none', 'cpu', 'nvme')",
        "distributed_type: MEGATRON_LM\n": "Megatron-LM",
        "distributed_type: MULTI_CPU\ndynamo_config:\n  dynamo_backend: NO_SUCH\n": "'no_such' is not a torch.compile backend",
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n": "use accelerate launch for SageMaker",
        "distributed_type: MULTI_NPU\n": "it runs on CUDA GPUs, CPUs and TPUs",
        "distributed_type: MULTI_CPU\nnum_processes: 3\nnum_machines: 2\n": "not a multiple of num_machines: 2",
        "distributed_type: MULTI_CPU\nnum_processes: -1\n": "give --num-processes N",
        "distributed_type: MULTI_GPU\nrdzv_backend: c10d\n": "set rdzv_backend: static",
        "distributed_type: MULTI_GPU\ngpu_ids: first\n": "give GPU numbers separated by commas",
        "num_processes: [2\n": "is not valid YAML",
        "- a list\n": "is not an Accelerate config",
    }
    for number, (text, says) in enumerate(cases.items()):
        config = write(tmp_path, f"refused{number}.yaml", text)
        done = nblaunch("--config_file", config, "report.py", cwd=tmp_path)
        assert done.returncode == 2, (text, done.stdout, done.stderr)
        assert done.stderr.startswith("nblaunch launch: ") and says in done.stderr, (text, done.stderr)
        assert done.stdout == "" and "Traceback" not in done.stderr
    done = nblaunch("--config_file", tmp_path / "missing.yaml", "report.py", cwd=tmp_path)
    assert done.returncode == 2 and "no such config file" in done.stderr
    config = write(tmp_path, "gpus.yaml", "distributed_type: MULTI_GPU\nnum_processes: 1\ngpu_ids: 0\n")
    done = nblaunch("--config_file", config, "report.py", cwd=tmp_path, CUDA_VISIBLE_DEVICES="1")
    assert done.returncode == 2 and "gpu_ids: 0 and CUDA_VISIBLE_DEVICES=1 disagree" in done.stderr


def test_a_dynamo_config_and_the_dynamo_flags_reach_every_ranks_accelerator(tmp_path):
    write(tmp_path, "report.py", """
        from nblaunch import Accelerator

        plugin = Accelerator().state.dynamo_plugin
        print(plugin.backend, plugin.mode, plugin.fullgraph, plugin.use_regional_compilation)
    """)
    config = write(tmp_path, "dynamo.yaml", CPU_BF16 + """
    dynamo_config:
      dynamo_backend: AOT_EAGER
      dynamo_mode: default
      dynamo_use_fullgraph: true
      dynamo_use_dynamic: false
      dynamo_use_regional_compilation: false
""")
    done = nblaunch("--config_file", config, "--dynamo_mode", "max-autotune", "--dynamo_use_regional_compilation",
                    "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout) == [f"[rank {r}] aot_eager max-autotune True True" for r in (0, 1)]
    done = nblaunch("--num_processes", "2", "--cpu", "--dynamo_backend", "nosuch", "report.py", cwd=tmp_path)
    assert done.returncode == 2 and "'nosuch' is not a torch.compile backend here" in done.stderr
    assert done.stdout == ""


@pytest.mark.slow
def test_a_deepspeed_config_reaches_every_ranks_accelerator(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: DeepSpeed's import sets variables
        pytest.skip("DeepSpeed is not installed")
    write(tmp_path, "report.py", """
        from nblaunch import Accelerator

        accelerator = Accelerator()
        plugin = accelerator.deepspeed_plugin
        print(accelerator.distributed_type.value, plugin.zero_stage, plugin.offload_optimizer_device,
              plugin.deepspeed_config["gradient_clipping"])
    """)
    config = write(tmp_path, "deepspeed.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: DEEPSPEED
        num_processes: 2
        deepspeed_config:
          zero_stage: 3
          offload_optimizer_device: cpu
          gradient_clipping: 0.5
          zero3_init_flag: false
          deepspeed_multinode_launcher: standard
    """)
    done = nblaunch("--config_file", config, "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reports = [line.split()[-4:] for line in rank_lines(done.stdout) if "DEEPSPEED" in line]  # DeepSpeed talks too
    assert reports == [["DEEPSPEED", "3", "cpu", "0.5"]] * 2


def test_gpu_ids_become_cuda_visible_devices_in_every_rank(tmp_path):
    write(tmp_path, "report.py", REPORT)
    config = write(tmp_path, "gpus.yaml", "distributed_type: MULTI_GPU\nnum_processes: 1\ngpu_ids: 0\n")
    done = nblaunch("--config_file", config, "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout) == ["[rank 0] world 1 precision no fsdp False gpus '0'"]


@pytest.mark.slow
def test_the_default_file_under_hf_home_is_read_as_accelerate_launch_reads_it(tmp_path):
    write(tmp_path, "report.py", REPORT)
    default = write(tmp_path, "hf/accelerate/default_config.yaml", CPU_BF16)
    done = nblaunch("report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"nblaunch: options from Accelerate's config {default} " in done.stdout
    assert rank_lines(done.stdout) == [f"[rank {r}] world 2 precision bf16 fsdp False gpus ''" for r in (0, 1)]
    # As accelerate launch: with --cpu the default file is not read (an explicit one would be).
    done = nblaunch("--cpu", "--num-processes", "1", "report.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "config" not in done.stdout and rank_lines(done.stdout) == ["[rank 0] world 1 precision no fsdp False gpus ''"]


@pytest.mark.slow
def test_an_fsdp_config_shards_the_model_in_every_ranks_accelerator(tmp_path):
    write(tmp_path, "shards.py", SHARDS)
    config = write(tmp_path, "fsdp.yaml", FSDP)
    done = nblaunch("--config_file", config, "shards.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout) == [f"[rank {r}] world 2 DistributedType.FSDP units ['', '0', '1'] "
                                       "parameters ['DTensor']" for r in (0, 1)]
    # A flag wins over fsdp_config: no wrap policy, the whole model one unit.
    done = nblaunch("--config_file", config, "--fsdp_auto_wrap_policy", "NO_WRAP", "shards.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rank_lines(done.stdout) == [f"[rank {r}] world 2 DistributedType.FSDP units [''] parameters ['DTensor']"
                                       for r in (0, 1)]


@pytest.mark.slow
def test_fsdp_settings_nblaunch_refuses_stop_the_command_before_any_rank_starts(tmp_path):
    write(tmp_path, "shards.py", SHARDS)
    config = write(tmp_path, "fsdp.yaml", FSDP + "      fsdp_activation_checkpointing_offload: true\n")
    done = nblaunch("--config_file", config, "shards.py", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert f"FSDP settings (fsdp_config in {config}, --fsdp_* flags)" in done.stderr
    assert "--fsdp_activation_checkpointing_offload false" in done.stderr
    done = nblaunch("--cpu", "--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD", "shards.py", cwd=tmp_path)
    assert done.returncode == 2 and "use FULL_SHARD or SHARD_GRAD_OP" in done.stderr
    done = nblaunch("--cpu", "--fsdp_auto_wrap_policy", "NO_WRAP", "shards.py", cwd=tmp_path)
    assert done.returncode == 2 and "--fsdp_auto_wrap_policy only applies to FSDP: add --use_fsdp" in done.stderr


@pytest.mark.slow
def test_configs_written_by_accelerate_itself_are_read_without_warnings(tmp_path):
    from accelerate.utils import write_basic_config

    write(tmp_path, "report.py", REPORT)
    yaml_file, json_file = tmp_path / "default.yaml", tmp_path / "basic.json"
    made = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default",
                           "--config_file", str(yaml_file), "--mixed_precision", "bf16"],
                          capture_output=True, text=True, env=dict(os.environ, HF_HOME=str(tmp_path / "hf")))
    assert made.returncode == 0, made.stderr
    assert write_basic_config(save_location=json_file)
    for config, precision in ((yaml_file, "bf16"), (json_file, "no")):
        done = nblaunch("--config_file", config, "--cpu", "report.py", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        # distributed_type NO (what Accelerate writes on a machine with one GPU or none): one process
        written = read_config(str(config))
        world = 1 if written.distributed_type == "NO" else written.total_processes
        assert f"[rank 0] world {world} precision {precision} fsdp False gpus ''" in done.stdout


def test_a_yaml_file_without_pyyaml_says_what_to_install(tmp_path, monkeypatch):
    config = write(tmp_path, "cpu_bf16.yaml", CPU_BF16)
    monkeypatch.setitem(sys.modules, "yaml", None)  # what `import yaml` meets where PyYAML is not installed
    with pytest.raises(ConfigError, match="pip install pyyaml"):
        read_config(str(config))
    json_config = write(tmp_path, "cpu.json", '{"distributed_type": "MULTI_CPU", "num_processes": 2}')
    assert read_config(str(json_config)).total_processes == 2  # JSON needs no PyYAML


def test_the_fsdp_variables_build_the_plugin_as_accelerates_accelerator_does():
    assert fsdp_plugin_from_environment({}) is None
    assert fsdp_plugin_from_environment({"ACCELERATE_USE_FSDP": "false", "FSDP_OFFLOAD_PARAMS": "true"}) is None
    plugin = fsdp_plugin_from_environment({
        "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "True",
        "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000", "FSDP_SYNC_MODULE_STATES": "1",
        "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_IGNORED_MODULES": "head"})
    assert (plugin.fsdp_version, plugin.cpu_offload, plugin.auto_wrap_policy, plugin.min_num_params) == (
        2, True, "SIZE_BASED_WRAP", 1000)
    assert (plugin.sync_module_states, plugin.reshard_after_forward, plugin.ignored_modules) == (True, "false", "head")
    assert plugin.activation_checkpointing is None  # not set: nblaunch's default
    with pytest.raises(ValueError, match="FSDP_OFFLOAD_PARAMS='maybe': give true or false"):
        fsdp_plugin_from_environment({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "maybe"})
    with pytest.raises(NotImplementedError, match="fsdp_activation_checkpointing_offload"):
        fsdp_plugin_from_environment({"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"})
