"""How a model is spread over the ranks: one object per way (``Replicated``: DDP or none,
``Sharded``: FSDP2, ``DeepSpeedStrategy``: ZeRO, ``TensorParallel``: a DeviceMesh plan), chosen
once when the ``Accelerator`` is made (``picking``). A strategy owns what differs between them:
wrapping the model (and, for DeepSpeed, its optimizer and scheduler), backward, clipping, the
full state dict and the model's and optimizer's part of a checkpoint. Nothing above this folder
asks which strategy it has; a new stack is one new module here and one branch in ``picking``.

Imports ``runtime``, ``options``, ``model`` and ``step`` only.
"""
