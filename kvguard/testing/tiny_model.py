"""A tiny local Llama model directory that a real vLLM can serve without any download.

The directory holds a ``config.json`` (no weights: vLLM runs it with
``--load-format dummy``, which fills the weights with random values), a
``generation_config.json`` and a small word-level tokenizer, so both text and
token-id prompts work. Every file's content is a pure function of the
arguments: building the same model twice gives byte-identical files, and a
second call on an up-to-date directory writes nothing.

Shapes are chosen for vLLM's CPU attention, which needs a supported head size
(32 here) and a KV block size that is a multiple of 32. One KV block of the
main model takes ``2 (K, V) x 2 layers x 2 KV heads x 32 head_dim x 2 bytes =
512`` bytes per token, 16 KiB per 32-token block.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Final

VOCAB_SIZE: Final = 512
"""Token ids are ``0 .. VOCAB_SIZE - 1``; the tokenizer and both models share them."""

MAX_POSITION_EMBEDDINGS: Final = 2048
"""Longest sequence, in tokens, the model config admits (prompt plus output)."""

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS: Final = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
"""Special tokens; their ids are their positions here (``<s>`` is 1, ``</s>`` is 2)."""

DRAFT_NAME: Final = "kvguard-tiny-draft"

_WORD_TEXT: Final = (
    ". , ? ! ' the a an of to and in is it that was for on are with as be at by "
    "this have from or one had not but what all were when we there can your which "
    "their said if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much go "
    "good new write our me man too any day same right look think also around another "
    "came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number hello world "
    "quick brown fox jumps lazy dog cache block memory leak pool request server "
    "engine token model prompt answer question story tell once upon"
)
WORDS: Final = tuple(_WORD_TEXT.split())
"""In-vocabulary words (ids 4 ..), in id order: prompts made of them never hit ``<unk>``."""


def _vocab() -> dict[str, int]:
    """Word -> id for exactly ``VOCAB_SIZE`` entries: specials, common words, then fillers."""
    words = [*SPECIAL_TOKENS, *WORDS]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    return {word: token_id for token_id, word in enumerate(words)}


def _config(num_hidden_layers: int, **extra: object) -> dict[str, object]:
    """The ``config.json`` of a tiny ``LlamaForCausalLM``; hidden 128, 4 heads, 2 KV heads."""
    return {**extra,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "torch_dtype": "bfloat16",
    }


def _generation_config() -> dict[str, object]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


def _tokenizer_files() -> dict[str, bytes]:
    """The files ``PreTrainedTokenizerFast.save_pretrained`` writes for the word-level vocab."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel(_vocab(), unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = Whitespace()
    # transformers 5 leaves this constructor unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    with tempfile.TemporaryDirectory() as scratch:
        fast.save_pretrained(scratch)
        return {path.name: path.read_bytes() for path in Path(scratch).iterdir()}


def _json_bytes(value: dict[str, object]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _write_model(model_dir: Path, num_hidden_layers: int, **config: object) -> Path:
    """Write the model files into ``model_dir``, touching only files whose content differs.

    Each file is replaced atomically, so a concurrent reader (or a second writer)
    sees either the old or the new complete file, never a partial one.
    """
    files = {
        "config.json": _json_bytes(_config(num_hidden_layers, **config)),
        "generation_config.json": _json_bytes(_generation_config()),
        **_tokenizer_files(),
    }
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        target = model_dir / name
        if target.is_file() and target.read_bytes() == content:
            continue
        fd, scratch = tempfile.mkstemp(dir=model_dir, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        os.replace(scratch, target)
    return model_dir


def make_tiny_model(directory: Path, *, name: str = "kvguard-tiny") -> Path:
    """Create (or bring up to date) the tiny 2-layer model at ``directory / name``; return it.

    Idempotent: a second call with the same arguments leaves every file as it is.
    Serve it with ``--load-format dummy`` (weights are random, so outputs are noise).
    """
    return _write_model(directory / name, num_hidden_layers=2)


def make_draft_model(directory: Path, *, name: str = DRAFT_NAME) -> Path:
    """Create the 1-layer draft model at ``directory / name`` for speculative decoding.

    It shares the vocabulary and tokenizer of :func:`make_tiny_model`, as vLLM's
    ``draft_model`` method requires. Idempotent, like :func:`make_tiny_model`.
    """
    return _write_model(directory / name, num_hidden_layers=1)


SLIDING_WINDOW_TOKENS: Final = 64
"""The window of the hybrid model's sliding-attention layer, in tokens (two 32-token blocks)."""


def make_hybrid_model(directory: Path, *, name: str = "kvguard-tiny-hybrid") -> Path:
    """Create the 2-layer hybrid model at ``directory / name``: one sliding-window layer
    (:data:`SLIDING_WINDOW_TOKENS`) and one full-attention layer, so vLLM keeps two KV
    cache groups and frees blocks that slide out of the window while a request runs.
    Idempotent, like :func:`make_tiny_model`.
    """
    return _write_model(directory / name, num_hidden_layers=2,
                        layer_types=["sliding_attention", "full_attention"],
                        sliding_window=SLIDING_WINDOW_TOKENS)


def make_sliding_model(directory: Path, *, name: str = "kvguard-tiny-sliding") -> Path:
    """Create the 2-layer model at ``directory / name`` whose layers are all sliding-window
    (:data:`SLIDING_WINDOW_TOKENS`): one KV cache group, every block of a long request
    freed while it runs. Idempotent, like :func:`make_tiny_model`.
    """
    return _write_model(directory / name, num_hidden_layers=2,
                        layer_types=["sliding_attention", "sliding_attention"],
                        sliding_window=SLIDING_WINDOW_TOKENS)
