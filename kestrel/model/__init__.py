"""The model room: the family registry (data), loading, the one patcher and its forwards, attention layouts, LoRA attachment."""
