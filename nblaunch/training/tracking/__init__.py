"""Experiment trackers (TensorBoard, W&B, MLflow, trackio) behind Accelerate's
``Accelerator(log_with=...)``; each backend is imported only when asked for."""
