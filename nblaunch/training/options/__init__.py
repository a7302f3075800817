"""Accelerate's option objects, with Accelerate's names and fields: the kwargs handlers and
configuration classes (``kwargs``) and the FSDP plugin (``fsdp_plugin``; built from Accelerate's
``FSDP_*`` variables by ``fsdp_environment``), read into settings nblaunch checks before any
training step. Accelerate's own objects are accepted in their place.

Plain data: it imports nothing from the other folders of ``nblaunch.training``.
"""
