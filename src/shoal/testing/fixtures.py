"""Things tests build offline: a byte-level BPE tokenizer trained on the built-in corpus."""

from __future__ import annotations

from pathlib import Path


def corpus_bpe(folder: Path, vocab_size: int, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE of `vocab_size` ids trained on the built-in corpus (offline, about a second),
    saved as a Hugging Face tokenizer folder whose EOS token is `eos`; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shoal.data.text import default_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([default_corpus()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(folder)
    return folder
