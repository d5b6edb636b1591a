"""Datasets: reading files, detecting formats, tokenizing with response masks, batching."""

from kestrel.data.collate import Batch, BatchPlan
from kestrel.data.formats import FORMATS, Conversation, RowIssue, detect_format, load_conversations
from kestrel.data.tokenize import Sample, TokenizedDataset, tokenize_all

__all__ = ["Batch", "BatchPlan", "FORMATS", "Conversation", "RowIssue", "detect_format", "load_conversations",
           "Sample", "TokenizedDataset", "tokenize_all"]
