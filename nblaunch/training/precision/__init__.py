"""How a prepared model computes, beside how it is spread (``strategy/``): one ``Precision`` per
mode, each owning its autocast, its GradScaler (fp16's, saved with checkpoints), how it converts
a model (fp8's Float8Linear layers) and what it adds to a prepared optimizer; the stack's own
(DeepSpeed's config) where a strategy computes in its own. ``compiling`` is the last wrapping
step of ``prepare`` (``torch.compile``), which fp8 turns on by default on GPUs with fp8 units.

Modules: ``full`` (the seam: ``Precision``, full precision), ``half`` (fp16, bf16, the stack's own), ``float8`` (torchao),
``modes`` (the mode's word, the device's refusals, ``pick_precision``), ``autocast`` (the forward
wrapper), ``compiling`` (``CompileStep``).
"""
