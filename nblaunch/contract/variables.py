"""Every environment variable name the launcher and the ranks share, each written once, here.

The launcher sets them in each rank (``LaunchPlan.rank_environ``, the starters, ``nblaunch
launch``); the rank's side reads them (its process state, the ``Accelerator``'s precision and
FSDP plugin, a warm rank's process group). torch.distributed's, torchrun's and Accelerate's own
names are among them, so code written for those launchers reads the world nblaunch made.
``tests/test_contract.py`` checks that no other module spells one of these names out.

Example::

    from nblaunch.contract import variables
    os.environ[variables.WORLD_SIZE]   # "2" in a rank of a 2-rank launch
"""

# torch.distributed's rendezvous, as torchrun sets it.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# torchrun's elastic names: libraries trust the variables above when RUN_ID is set, and code
# written for restarts reads the other two to resume.
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
# "True": the launcher hosts the rendezvous store (as torchrun's agent does); every rank is its client.
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
# "1": init_process_group returns once every rank's group is connected (torch's store barrier).
TORCH_DIST_INIT_BARRIER = "TORCH_DIST_INIT_BARRIER"

# nblaunch's own.
MIXED_PRECISION = "NBLAUNCH_MIXED_PRECISION"  # the launch's mixed_precision=, for Accelerator()
FORCE_CPU = "NBLAUNCH_FORCE_CPU"  # "1": cpu=True, debug_launcher (the GPUs are hidden too)
XLA_LAUNCH = "NBLAUNCH_XLA"  # "1" in every rank of an XLA launch
DISTRIBUTED_TYPE = "NBLAUNCH_DISTRIBUTED_TYPE"  # "XLA": asks a process outside a launch for XLA
LAUNCH_ID = "NBLAUNCH_LAUNCH_ID"  # every process of a launch carries it: found and stopped by it
STATE_DIR = "NBLAUNCH_STATE_DIR"  # where detached launches are kept (the user's choice)

# Hugging Face Accelerate's, as its own launchers set them: code that keeps `accelerate` (and
# transformers' Trainer) gets the same launch.
ACCELERATE_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"
ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"
ACCELERATE_DEBUG_MODE = "ACCELERATE_DEBUG_MODE"
ACCELERATE_LOG_LEVEL = "ACCELERATE_LOG_LEVEL"
# Accelerate's FSDP settings: each flag of `accelerate launch` (and key of a config file's
# fsdp_config) with the variable its launcher sets.
FSDP_VARIABLES = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}

# The devices a rank sees, and its threads.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PJRT_DEVICE = "PJRT_DEVICE"  # torch_xla's device kind: "TPU", or "CPU" for XLA on the CPU
CPU_NUM_DEVICES = "CPU_NUM_DEVICES"  # XLA devices on the CPU
OMP_NUM_THREADS = "OMP_NUM_THREADS"
MKL_NUM_THREADS = "MKL_NUM_THREADS"
