"""Datasets: reading files, detecting formats, tokenizing with response masks, batching."""

from engine.data.collate import Batch, BatchPlan
from engine.data.formats import FORMATS, Conversation, RowIssue, detect_format, load_conversations
from engine.data.tokenize import Sample, TokenizedDataset, tokenize_all

__all__ = ["Batch", "BatchPlan", "FORMATS", "Conversation", "RowIssue", "detect_format", "load_conversations",
           "Sample", "TokenizedDataset", "tokenize_all"]
