"""``nblaunch launch [options] script.py [script args]`` (or ``-m module``): every rank runs the
script as ``__main__`` under nblaunch's supervision, as a notebook launch runs a function.

The flags a user of ``accelerate launch`` or ``torchrun`` types are understood under their own
spellings (``--num_processes``, ``--nproc-per-node``, ``--main_process_port``, ``--use_fsdp``, ...);
the ones nblaunch has no meaning for are refused by name, with what to do instead. Accelerate's
config files are read too (``--config_file``, or its default file): ``cli/accelerate_config``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from nblaunch.cli.dynamo_options import add_dynamo_flags, dynamo_environ
from nblaunch.cli.accelerate_config import (ConfigError, apply_config, config_to_read, read_config,
                                            visible_devices)
from nblaunch.cli.args import at_least_one, at_least_zero, precision, processes, seconds
from nblaunch.cli.outcome import USAGE, launch_in_terminal
from nblaunch.cli.script import Script
from nblaunch.contract.precision import PRECISIONS
from nblaunch.contract.variables import CUDA_VISIBLE_DEVICES, FSDP_VARIABLES
from nblaunch.clusters import CLUSTERS

_DESCRIPTION = """\
Run a training script on several processes: each one runs it as __main__ with the same
arguments, RANK/WORLD_SIZE/MASTER_ADDR set, its output tagged with its rank. The first rank
that fails stops every rank within a second and is named first; Ctrl-C shows where every rank
was (in the log) and stops them all; the processes never outlive this command. A script that
trains through nblaunch's Accelerator stops at one step on Ctrl-C or --timeout and saves its
state there; --resume goes on from it.

Options can come from an Accelerate config file (what `accelerate config` writes): --config_file
PATH, or Accelerate's default file when it exists ($HF_HOME/accelerate/default_config.yaml;
HF_HOME defaults to ~/.cache/huggingface; not read with --cpu, as accelerate launch). Flags given
here win over the file. distributed_type FSDP (or --use_fsdp) shards with FSDP2: the fsdp_config
settings reach every rank's Accelerator.

exit status: 0 every rank succeeded, 1 a rank failed, 2 bad arguments, 124 --timeout ran out,
130 interrupted."""

_EXAMPLES = """\
examples:
  nblaunch launch --num-processes 2 train.py --lr 3e-4
  nblaunch launch --nproc-per-node 4 --mixed-precision bf16 -m my_project.train
  nblaunch launch --num-nodes 2 --node-rank 0 --master-addr 10.0.0.1 --port 29400 train.py
  nblaunch launch --config_file fsdp_config.yaml train.py
  nblaunch launch --num-processes 2 --use_fsdp --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block train.py"""

# accelerate launch / torchrun flags with no meaning here, and what to do instead.
_REFUSED = {
    "--use_deepspeed": "DeepSpeed is not supported by nblaunch",
    "--deepspeed_config_file": "DeepSpeed is not supported by nblaunch",
    "--use_megatron_lm": "Megatron-LM is not supported by nblaunch",
    "--tpu": "on a TPU host nblaunch uses torch_xla by itself; leave the flag out",
    "--rdzv-backend": "nblaunch sets a static rendezvous; use --master-addr and --port",
    "--rdzv_backend": "nblaunch sets a static rendezvous; use --master-addr and --port",
    "--rdzv-endpoint": "use --master-addr and --port",
    "--rdzv_endpoint": "use --master-addr and --port",
    "--rdzv-id": "not needed: the rendezvous is static",
    "--rdzv_id": "not needed: the rendezvous is static",
    "--num_cpu_threads_per_process": "each rank gets its share of the cores; set OMP_NUM_THREADS to choose",
    "--log-dir": "every rank's whole log is kept; its folder is printed when the launch starts",
    "--log_dir": "every rank's whole log is kept; its folder is printed when the launch starts",
    "--tee": "every rank's output is shown, tagged, and kept in its log",
    "--redirects": "every rank's output is shown, tagged, and kept in its log",
    "--monitor-interval": "not needed: nblaunch watches the ranks itself",
    "--monitor_interval": "not needed: nblaunch watches the ranks itself",
    "--no-python": "nblaunch runs Python scripts and modules (-m)",
    "--no_python": "nblaunch runs Python scripts and modules (-m)",
    "--main_training_function": "the script runs as __main__: call your function there",
    "--debug": "set ACCELERATE_DEBUG_MODE=1 for Accelerate's shape checks (nblaunch checks them always)",
}
# The FSDP flags --help shows (metavar, help); they take Accelerate's values.
_FSDP_HELP = {
    "fsdp_auto_wrap_policy": ("P", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP (default: the whole model "
                                   "is one unit)"),
    "fsdp_transformer_layer_cls_to_wrap": ("C", "with TRANSFORMER_BASED_WRAP: the layers' class names, e.g. Block"),
    "fsdp_min_num_params": ("N", "with SIZE_BASED_WRAP: a module with more parameters is a unit of its own"),
    "fsdp_reshard_after_forward": ("B", "true (default) or false: keep the gathered parameters until backward"),
    "fsdp_sharding_strategy": ("S", "FULL_SHARD (default) or SHARD_GRAD_OP"),
    "fsdp_offload_params": ("B", "true: parameters, gradients and optimizer state on the CPU"),
    "fsdp_state_dict_type": ("T", "SHARDED_STATE_DICT or FULL_STATE_DICT"),
    "fsdp_sync_module_states": ("B", "true: every rank starts from rank 0's weights"),
    "fsdp_activation_checkpointing": ("B", "true: each wrapped layer recomputes its activations in backward"),
    "fsdp_ignored_modules": ("RE", "modules whose names match are not sharded"),
}
_REFUSED_PREFIXES = {"--deepspeed": _REFUSED["--use_deepspeed"], "--megatron_lm": _REFUSED["--use_megatron_lm"]}


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {_REFUSED[option_string]}")


def add_parser(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="run a training script on several processes",
                                 description=_DESCRIPTION, epilog=_EXAMPLES, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = launch.add_argument
    add("--num-processes", "--num_processes", "--nproc-per-node", "--nproc_per_node", type=processes,
        default=None, metavar="N", help="processes on this machine (default, or gpu/auto: one per GPU, or 2 on the CPU where there is none)")
    # Defaults None: a flag not given leaves the config file's value (apply_config fills the rest).
    add("--mixed-precision", "--mixed_precision", type=precision, default=None, metavar="P",
        help=f"{', '.join(PRECISIONS)}: handed to every rank's Accelerator (default: no)")
    add("--num-nodes", "--num_machines", "--nnodes", type=at_least_one, default=None, metavar="K",
        help="machines taking part (default: 1)")
    add("--node-rank", "--machine_rank", "--node_rank", type=at_least_zero, default=None, metavar="R",
        help="this machine's number, 0 to K-1 (default: 0)")
    add("--master-addr", "--main_process_ip", "--master_addr", default=None, metavar="A",
        help="address of node 0 (default: 127.0.0.1)")
    add("--port", "--main_process_port", "--master_port", "--master-port", type=int, default=None, metavar="P",
        help="port of the rendezvous on node 0 (default: a free one; give it with --num-nodes > 1)")
    add("--cluster", choices=[name for name in CLUSTERS if name is not None], default=None,
        help="start the ranks on the nodes of a cluster: ray, the Ray cluster this machine is connected to "
             "(needs nblaunch[ray]); slurm, this Slurm job's nodes (every one unless --num-nodes)")
    add("--timeout", type=seconds, default=None, metavar="S",
        help="stop every rank, showing where each was, after S seconds")
    add("--resume", action="store_true",
        help="every rank's Accelerator loads the latest complete checkpoint before its first step: a run that "
             "Ctrl-C or --timeout stopped goes on where it stopped")
    add("--resume-from", "--resume_from", default=None, metavar="PATH",
        help="as --resume, from the checkpoint folder PATH")
    add("--max-restarts", "--max_restarts", type=at_least_zero, default=0, metavar="M",
        help="after a failure, start every rank again, up to M times")
    add("--start-method", choices=["fork", "spawn"], default=None,
        help="how the processes start (default: fork where it is safe, else spawn)")
    add("--cpu", action="store_true", help="every process on the CPU, GPUs hidden: as many as you like on a one-GPU machine")
    add("--multi_gpu", "--multi-gpu", action="store_true",
        help="accepted for accelerate launch: one process per GPU is already the default")
    add("--standalone", action="store_true",
        help="accepted for torchrun: one machine and a free port are already the default")
    add("-m", "--module", action="store_true",
        help="the script is a module name, run as python -m would (e.g. -m my_project.train)")
    add("--config_file", "--config-file", default=None, metavar="PATH",
        help="an Accelerate config file (YAML, or .json) to take the options from (default: Accelerate's "
             "default file, if there is one)")
    add("--gpu_ids", "--gpu-ids", default=None, metavar="IDS",
        help="the GPUs to use, e.g. 0,1 (as CUDA_VISIBLE_DEVICES=0,1; default: all)")
    fsdp = launch.add_argument_group("FSDP (accelerate launch's flags; FSDP2 underneath)")
    fsdp.add_argument("--use_fsdp", "--use-fsdp", action="store_true",
                      help="shard models with FSDP: every rank's Accelerator() gets the settings below")
    for key in FSDP_VARIABLES:  # all of accelerate launch's; the ones --help leaves out do nothing here, or are refused
        fsdp.add_argument(f"--{key}", default=None, metavar=_FSDP_HELP.get(key, ("V",))[0],
                          help=_FSDP_HELP[key][1] if key in _FSDP_HELP else argparse.SUPPRESS)
    add_dynamo_flags(launch)
    for flag in _REFUSED:
        add(flag, nargs="?", action=_Refuse, help=argparse.SUPPRESS)
    add("script", metavar="script.py", help="the training script (or, with -m, a module)")
    add("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for the script")


def split_at_script(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` of ``launch`` cut after the script: the launcher's options and the script, then
    the script's own arguments, untouched (``--``, and options that look like the launcher's).

    Example::

        split_at_script(parser, ["--num-processes", "2", "train.py", "--n", "3"])
        # (["--num-processes", "2", "train.py"], ["--n", "3"])
    """
    takes_value = {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
        if not arg.startswith("-") or arg == "-":
            return argv[:i + 1], argv[i + 1:]
        name = arg.split("=", 1)[0]
        i += 2 if takes_value.get(name) and "=" not in arg else 1
    return argv, []


def run(options: argparse.Namespace) -> int:
    problem = _target_problem(options.script, options.module)
    if problem:
        print(f"nblaunch launch: {problem}", file=sys.stderr)
        return USAGE
    try:
        path = config_to_read(options.config_file, options.cpu)
        config = read_config(path) if path else None
        rank_environ = apply_config(options, config)
        rank_environ.update(dynamo_environ(options, config.dynamo if config is not None else {}))
        devices = visible_devices(options.gpu_ids, options.cpu, options.cluster,
                                  os.environ.get(CUDA_VISIBLE_DEVICES))
    except (ConfigError, ValueError) as error:
        print(f"nblaunch launch: {error}", file=sys.stderr)
        return USAGE
    if config is not None:
        print(f"nblaunch: options from Accelerate's config {path} (flags given here win)", flush=True)
        if config.unknown:
            print(f"nblaunch launch: warning: {path} has keys nblaunch does not know, ignored: "
                  f"{', '.join(config.unknown)}", file=sys.stderr, flush=True)
    if devices is not None:
        os.environ[CUDA_VISIBLE_DEVICES] = devices  # before the launch counts the GPUs; the ranks inherit it
    _, status = launch_in_terminal(
        "launch", Script(options.script, options.script_args, options.module, rank_environ), (),
        num_processes=options.num_processes, mixed_precision=options.mixed_precision,
        num_nodes=options.num_nodes, node_rank=options.node_rank, master_addr=options.master_addr,
        use_port=options.port, cluster=options.cluster, timeout=options.timeout,
        max_restarts=options.max_restarts, start_method=options.start_method, cpu=options.cpu,
        resume=options.resume_from or options.resume)
    return status


def refused_prefix(own: list[str]) -> str | None:
    """A message for a refused family of flags (``--fsdp_*``) among the launcher's own arguments
    (``split_at_script``'s first part), else None."""
    for arg in own:
        for prefix, why in _REFUSED_PREFIXES.items():
            if arg.startswith(prefix):
                return f"{arg.split('=')[0]} is not supported: {why}"
    return None


def _target_problem(target: str, as_module: bool) -> str | None:
    if as_module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError) as error:
            return f"cannot find module {target!r}: {error}"
        finally:
            sys.path.pop(0)
        return None if found is not None else f"no module named {target!r} (run from the directory that holds it)"
    if not os.path.isfile(target):
        return f"no such script: {target!r}" + (" (a module? add -m)" if not target.endswith(".py") else "")
    return None
