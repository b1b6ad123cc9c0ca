"""Small reference models and data used by the demo, the tests and the benchmarks."""

from .causal_lm import CausalLM
from .data import CharTokenizer, tiny_corpus, token_batches
from .gpt import GPT, GPTConfig

__all__ = ["CausalLM", "GPT", "GPTConfig", "CharTokenizer", "tiny_corpus", "token_batches"]
