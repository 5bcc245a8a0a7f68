"""A completion's text from its token ids, after generation: the text vLLM's fast detokenizer
would have built while generating.

Asked for the sampled tokens' log-probs (the importance weights need them), vLLM decodes every
sampled token once more for its log-prob entry: on CPUs a sizeable share of an engine's
generation time for the built-in task (bench/cpu_floor.py phases). So training
samples are generated without vLLM's detokenization (when no stop string needs it) and decoded
here once, the way vLLM would: one `DecodeStream` primed with the prompt, stepped token by token
(so text held back for an incomplete UTF-8 character at the end is dropped, not replaced), the
token that stopped the completion left out unless `include_stop` says otherwise.
"""
from __future__ import annotations

from typing import Optional, Sequence

INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' error when a stream's state breaks


def fast_tokenizer(tokenizer) -> Optional[object]:
    """The Rust `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (what vLLM's fast
    detokenizer steps); None for a slow one (vLLM then detokenizes itself)."""
    from tokenizers import Tokenizer

    rust = getattr(tokenizer, "_tokenizer", None)
    return rust if isinstance(rust, Tokenizer) else None


def completion_text(rust_tokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int], stopped_by_token: bool,
                    include_stop: bool = False, skip_special_tokens: bool = True) -> str:
    """The completion's text; `stopped_by_token`: its last id is the stop token (EOS or a stop
    token id), which vLLM leaves out of the text unless `include_stop`."""
    from tokenizers.decoders import DecodeStream

    ids = list(token_ids[:-1]) if stopped_by_token and not include_stop and token_ids else list(token_ids)
    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
    pieces = []
    for token in ids:
        try:
            piece = stream.step(rust_tokenizer, token)
        except (OverflowError, TypeError):  # an id the tokenizer cannot decode: no text, as in vLLM
            piece = None
        except Exception as e:
            if not str(e).startswith(INVALID_PREFIX):
                raise
            # Non-monotonic output broke the stream's state: start a fresh one from this token.
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            piece = stream.step(rust_tokenizer, token)
        pieces.append(piece or "")
    return "".join(pieces)
