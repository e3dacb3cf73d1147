"""Shipped data, tokenizer, synthetic generators and resumable distributed loaders.

Everything a training run reads is in the package (``corpora/``): nothing is downloaded at run
time. Names for configs: :data:`DATASETS`; build one with :func:`get_dataset` and feed it to
:func:`build_loader`.
"""

from .images import DigitsDataset, load_digits
from .loader import ResumableDistributedSampler, build_loader
from .registry import DATASETS, DEFAULT_SEQ_LEN, DatasetInfo, get_dataset
from .synthetic import SyntheticImages, SyntheticTokens
from .text import TextDataset, byte_unigram_entropy, load_text
from .tokenizer import ByteTokenizer

__all__ = [
    "DATASETS",
    "DEFAULT_SEQ_LEN",
    "ByteTokenizer",
    "DatasetInfo",
    "DigitsDataset",
    "ResumableDistributedSampler",
    "SyntheticImages",
    "SyntheticTokens",
    "TextDataset",
    "build_loader",
    "byte_unigram_entropy",
    "get_dataset",
    "load_digits",
    "load_text",
]
