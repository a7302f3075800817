"""Issue 31, item 5: a tiny ``transformers.Trainer`` (built from a config: nothing is downloaded)
on the GPU under ``notebook_launcher``, with ``mixed_precision="bf16"`` given to the launcher
reaching the Trainer's Accelerator: its forward computes in bf16 on the GPU, unchanged user code.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gpu_common import GPU_MARKS
from nblaunch import notebook_launcher

pytestmark = GPU_MARKS

NUM_EXAMPLES = 64
BATCH = 8


def train_tiny_bert(output_dir: str) -> dict:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    dtypes: list[str] = []
    model.classifier.register_forward_hook(lambda module, inputs, output: dtypes.append(str(output.dtype)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (NUM_EXAMPLES, 16), generator=g)
    labels = torch.randint(0, 2, (NUM_EXAMPLES,), generator=g)
    dataset = [{"input_ids": ids[i], "labels": labels[i]} for i in range(NUM_EXAMPLES)]
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH, num_train_epochs=2,
                             report_to=[], save_strategy="no", logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    output = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "world_size": args.world_size, "args_device": str(args.device), "steps": trainer.state.global_step,
        "mixed_precision": trainer.accelerator.mixed_precision, "args_bf16": bool(args.bf16),
        "dtype": dtypes[0] if dtypes else None,
        "parameter_devices": sorted({str(p.device) for p in trainer.model.parameters()}),
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "train_runtime": output.metrics.get("train_runtime"),
    }


def test_a_tiny_trainer_trains_on_the_gpu_in_bf16_given_to_the_launcher(tmp_path, record_property):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    [result] = notebook_launcher(train_tiny_bert, args=(str(tmp_path),), num_processes=1,
                                 mixed_precision="bf16", display="none", timeout=300)
    record_property("trainer", repr(result))
    assert result["world_size"] == 1 and result["args_device"] == "cuda:0"
    assert result["parameter_devices"] == ["cuda:0"]
    assert result["steps"] == 2 * NUM_EXAMPLES // BATCH
    assert result["mixed_precision"] == "bf16" and result["dtype"] == "torch.bfloat16", result
    assert result["last_loss"] is not None and result["last_loss"] == result["last_loss"]  # trained, no NaN
