"""A Hugging Face `transformers.Trainer` script, run unmodified (a tiny BERT built from a config:
nothing is downloaded).

    audit run examples/hf_trainer.py --steps 12

The steps are the Trainer's optimizer steps. Its settings cost it time: the loss logged every step
(`logging_steps=1`: the Trainer reads the loss back to the host for each log), and each example read
from storage in the training process while the step waits (`dataloader_num_workers=0`). Those are
findings about the Trainer's configuration, fixed in `TrainingArguments`, not by editing the
`trainer.train()` line.
"""
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Sentences(Dataset):
    """Random token ids and labels, made per item as a tokenizer would."""

    def __init__(self, n, length=32, vocab=512):
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.02)  # reading the example from storage
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.length,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": i % 2}


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=200, per_device_train_batch_size=8,
                                 learning_rate=1e-3, logging_steps=1, dataloader_num_workers=0,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Sentences(1024))
        trainer.train()


if __name__ == "__main__":
    main()
