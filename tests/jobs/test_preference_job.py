"""A DPO job runs through the job runner with the real engine on the demo model (CPU): its kind
is `preference` and every step's TRL-named metrics reach the store."""

from __future__ import annotations

import pytest

from kestrel import jobs
from jobkit import config, job, steps, wait_status
from kestrel.jobs.models import COMPLETED


@pytest.fixture(autouse=True)
def real_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "kestrel.training.run:run")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_dpo_job_completes_with_reward_metrics_in_the_store() -> None:
    job_id = jobs.submit(config(method="dpo", dataset="arithmetic_preferences", max_steps=3, save_steps=0,
                                max_seq_length=64, gradient_checkpointing="off"))
    assert job(job_id).kind == "preference"
    done = wait_status(job_id, timeout=600.0)
    assert done.status == COMPLETED, jobs.log_tail(job_id)
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "tokens_per_s"):
        assert steps(job_id, name) == [1, 2, 3], name
    assert "paired preference data (text layout), 300 rows used" in jobs.log_tail(job_id)
    assert [a.kind for a in jobs.list_artifacts(job_id, "adapter")] == ["adapter"]
