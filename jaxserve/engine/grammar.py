"""Structured output at the engine's door: a request's StructuredOutputs -> an llguidance grammar,
checked against the model's tokenizer (a bad schema, regex or grammar is a ValueError naming the
problem, before the request is queued), and one matcher per sample when it is queued.

The llguidance tokenizer is built once, on first use or by `warm` (about a second; a server's
background warm-up calls it: engine/warm_start.py), from the engine's Hugging
Face tokenizer, with the model's vocabulary size (ids the tokenizer lacks are never allowed) and
its EOS ids (allowed once the grammar accepts).
"""

from __future__ import annotations

import threading

from jaxserve.refusals import InvalidGrammar
from jaxserve.runner.token_mask import TokenConstraint
from jaxserve.structured_outputs import StructuredOutputs


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()     # the door runs in several tokenizer threads

    def warm(self) -> None:
        """Build the llguidance tokenizer now (if the engine has a tokenizer), not at the first grammar."""
        if self._hf_tokenizer is not None:
            self._tokenizer()

    @property
    def warm_done(self) -> bool:
        return self._ll_tokenizer is not None

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("SamplingParams.structured_outputs needs the model's tokenizer; this engine has none")
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """The checked grammar of spec; ValueError with llguidance's message when it does not compile."""
        from llguidance import LLMatcher

        try:
            grammar = spec.to_grammar()
        except ValueError as e:
            raise InvalidGrammar(f"SamplingParams.structured_outputs: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error:
            raise InvalidGrammar(f"SamplingParams.structured_outputs does not compile: {error.strip()}")
        return grammar

    def constraint(self, grammar: str) -> TokenConstraint:
        from llguidance import LLMatcher

        return TokenConstraint(LLMatcher(self._tokenizer(), grammar, log_level=0))
