"""What this process and machine are, asked without changing them: whether CUDA was started
here (``cuda``), the GPUs as NVML sees them (``nvml``), which loaded modules are installed
libraries (``installed``). The foundation: nothing here imports the rest of nblaunch."""
