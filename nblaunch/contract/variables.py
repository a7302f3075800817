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
STEP_SPLIT = "NBLAUNCH_STEP_SPLIT"  # "0": the ranks do not split their steps (nblaunch.worker.step_clock)
STALL_AFTER = "NBLAUNCH_STALL_AFTER"  # the launch's stall_after= in seconds; absent: no stall watch
LAUNCH_ID = "NBLAUNCH_LAUNCH_ID"  # every process of a launch carries it: found and stopped by it
COMPILE_CACHE = "NBLAUNCH_COMPILE_CACHE"  # where ranks keep torch.compile's code (launch/planning/compile_cache)
TORCHINDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"  # torch's: Inductor's on-disk caches
TORCHINDUCTOR_COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"  # torch's: Inductor's compile workers per process
STATE_DIR = "NBLAUNCH_STATE_DIR"  # where detached launches and launches' checkpoints are kept (the user's choice)
RESUME = "NBLAUNCH_RESUME"  # resume=: "latest", or the checkpoint folder to load before the first step
CHECKPOINTS = "NBLAUNCH_CHECKPOINTS"  # where a stopped launch saves when its Accelerator has no project_dir
AGENT_TOKEN = "NBLAUNCH_AGENT_TOKEN"  # what a node's agent shows the driver it connects to (never on a command line)
# The user's setting: "0" imports nothing for the ranks where they are forked from (launch/starting/preload).
PRELOAD = "NBLAUNCH_PRELOAD"

# Slurm's (cluster="slurm"): the allocation a kernel sits in, as Slurm tells its processes.
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_JOB_CPUS_PER_NODE = "SLURM_JOB_CPUS_PER_NODE"  # "4(x2),2": counts per node, run-length coded
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
SLURM_GPUS_PER_NODE = "SLURM_GPUS_PER_NODE"  # "4" or "a100:4": what the job asked for each node
SLURM_JOB_GPUS = "SLURM_JOB_GPUS"  # "0,1": the GPUs of the job on this node
SLURM_PROCID = "SLURM_PROCID"  # a task's number in its step: the agent's node number
SLURM_LAUNCH_NODE_IPADDR = "SLURM_LAUNCH_NODE_IPADDR"  # srun's host, as its tasks' nodes reach it
SLURM_CONF = "SLURM_CONF"
# The job's own, kept in the ranks: the rest (a task's SLURM_PROCID, SLURM_NTASKS, ...) describe
# the agent's task, and would make Lightning or Accelerate believe srun started each rank.
SLURM_JOB_LEVEL = (SLURM_JOB_ID, "SLURM_JOBID", SLURM_JOB_NODELIST, "SLURM_JOB_NUM_NODES", "SLURM_CLUSTER_NAME",
                   "SLURM_JOB_PARTITION", "SLURM_JOB_ACCOUNT", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST", SLURM_CONF,
                   "SLURM_JOB_USER", "SLURM_JOB_UID", "SLURM_JOB_NAME")
# Prefixes of what Slurm's tools read as options (srun reads SLURM_*, salloc SALLOC_*, sbatch
# SBATCH_*) or an MPI reads as its world: none of it may reach a step nblaunch starts, or a rank.
SLURM_INPUT_PREFIXES = ("SLURM_", "SRUN_", "SALLOC_", "SBATCH_", "PMI_", "PMIX_", "OMPI_")
# What a user's environment already asks sbatch for: a launch outside an allocation asks the same.
SBATCH_DEFAULTS = {"partition": "SBATCH_PARTITION", "account": "SBATCH_ACCOUNT", "time": "SBATCH_TIMELIMIT",
                   "qos": "SBATCH_QOS", "reservation": "SBATCH_RESERVATION", "constraint": "SBATCH_CONSTRAINT"}

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

ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
# Accelerate's DeepSpeed settings: each key of a config file's `deepspeed_config` (and flag of
# `accelerate launch`) and the variable DeepSpeedPlugin() reads it from.
DEEPSPEED_VARIABLES = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
}
ACCELERATE_FP8_BACKEND = "ACCELERATE_FP8_BACKEND"  # "AO" (torchao), "TE", "MSAMP"
ACCELERATE_USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"  # "true": Accelerator() builds one
# Accelerate's ParallelismConfig sizes: the field and its variable.
PARALLELISM_VARIABLES = {
    "dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "tp_size": "PARALLELISM_CONFIG_TP_SIZE",
    "cp_size": "PARALLELISM_CONFIG_CP_SIZE",
}

# The devices a rank sees, and its threads.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PJRT_DEVICE = "PJRT_DEVICE"  # torch_xla's device kind: "TPU", or "CPU" for XLA on the CPU
CPU_NUM_DEVICES = "CPU_NUM_DEVICES"  # XLA devices on the CPU
OMP_NUM_THREADS = "OMP_NUM_THREADS"
MKL_NUM_THREADS = "MKL_NUM_THREADS"
# "0": torch starts no pool of compile workers at import (the launch server's processes fork
# ranks, and must stay one thread with no children of their own).
TORCH_WARM_POOL = "TORCH_WARM_POOL"
