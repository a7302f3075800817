"""transformers' Trainer, unchanged, under nblaunch's launcher: real DDP on the CPU with default
TrainingArguments, and mixed precision given to the launcher reaches it."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch

import nblaunch
from nblaunch import notebook_launcher

NUM_EXAMPLES = 32
BATCH = 2


class IndexedTexts(torch.utils.data.Dataset):
    """Random token ids with labels; each example carries its index so ranks can say which
    ones they trained on."""

    def __init__(self, vocab_size: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (NUM_EXAMPLES, 12), generator=generator)
        self.labels = torch.randint(0, 2, (NUM_EXAMPLES,), generator=generator)

    def __len__(self):
        return NUM_EXAMPLES

    def __getitem__(self, i):
        return {"idx": i, "input_ids": self.ids[i], "labels": self.labels[i]}


def train_tiny_bert(output_dir: str):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    seen: list[int] = []
    dtypes: list[torch.dtype] = []
    model.classifier.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))

    def collate(features):
        seen.extend(f["idx"] for f in features)
        return {"input_ids": torch.stack([f["input_ids"] for f in features]),
                "labels": torch.stack([f["labels"] for f in features])}

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH, num_train_epochs=1,
                             report_to=[], save_strategy="no", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=IndexedTexts(config.vocab_size), data_collator=collate)
    trainer.train()
    weights = torch.cat([p.detach().flatten().float() for p in trainer.model.parameters()])
    return {
        "world_size": args.world_size,
        "steps": trainer.state.global_step,
        "seen": seen,
        "checksum": weights.double().sum().item(),
        "weights": weights,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "dtype": str(dtypes[0]),
    }


def test_trainer_with_default_arguments_runs_real_ddp_on_two_cpu_ranks(tmp_path):
    results = notebook_launcher(train_tiny_bert, args=(str(tmp_path),), num_processes=2, display="none")
    steps_alone = NUM_EXAMPLES // BATCH
    for r in results:
        assert r["world_size"] == 2
        assert r["steps"] == steps_alone // 2  # half the steps a single process takes
        assert r["mixed_precision"] == "no" and r["dtype"] == "torch.float32"
    shard0, shard1 = set(results[0]["seen"]), set(results[1]["seen"])
    assert not shard0 & shard1, "the ranks trained on overlapping examples"
    assert shard0 | shard1 == set(range(NUM_EXAMPLES))
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], rtol=0, atol=0)
    steps = nblaunch.last_steps()  # the Trainer's loop is Accelerate's: said once, nothing measured
    assert not steps.ranks and len(steps.notes) == 1 and "transformers' Trainer uses it" in steps.notes[0], str(steps)


def test_mixed_precision_given_to_the_launcher_reaches_trainer(tmp_path):
    results = notebook_launcher(train_tiny_bert, args=(str(tmp_path),), num_processes=2,
                                mixed_precision="bf16", display="none")
    for r in results:
        assert r["world_size"] == 2 and r["steps"] == NUM_EXAMPLES // BATCH // 2
        assert r["mixed_precision"] == "bf16"
        assert r["dtype"] == "torch.bfloat16"
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], rtol=0, atol=0)
