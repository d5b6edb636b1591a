"""What whoever started the studio decided on its command line (`kestrel.studio.launch`), passed
down to the handlers that need it. Nothing here can be changed from a browser: a setting that
lets a logged-in user run code (custom GRPO rewards) belongs to the person who started the studio.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.studio.files import DEFAULT_MAX_UPLOAD_MB


@dataclass(frozen=True)
class StudioSettings:
    max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB  # larger uploads are refused (Gradio and the handler both check)
    loaded_models: int = 2  # base models the Chat tab keeps loaded at once
    # GRPO runs may import a reward from a .py file (`--allow-custom-rewards`): that file runs in
    # the training job with the studio owner's permissions, so only the owner can turn it on.
    allow_custom_rewards: bool = False
