"""Retraining at growing data scales: extract what is new -> train -> evaluate by real decoding -> promote.

- `job` (`run_retrain`, `RetrainConfig`): the scales, each one's extraction and training, the promotion decision,
  MLflow's parent and child runs.
- `evaluate` (`evaluate_draft`, `evaluate_on_worker`): candidate and champion decoded on held-out prompts on the
  target, in a Ray task; with the serving-engine gate (`serving_gates`, `pipelines/serving_gate.py`) also in vLLM,
  which `job.promote` obeys.
- `traffic`: retraining from served traffic (`RetrainConfig.traffic`): the mix, the held-out slice, the rule.

`from pipelines.retrain import ...` gives the names the module `pipelines/retrain.py` gave before it became this
package (the registry's names it re-exported included).
"""

from pipelines.registry import (CANDIDATE, CHAMPION, TAU_DTYPE_TAG, PromotionConflict, PromotionLease, alias_version,
                                client as registry_client, decide_promotion, register_draft_folder, rollback)
from pipelines.retrain.evaluate import check_eval_prompts, evaluate_on_worker
from pipelines.retrain.job import (RetrainConfig, count_corpus_rows, draft_output, features_url, run_retrain,
                                   scale_folder, scale_rows)

__all__ = ["CANDIDATE", "CHAMPION", "TAU_DTYPE_TAG", "PromotionConflict", "PromotionLease", "RetrainConfig",
           "alias_version", "check_eval_prompts", "count_corpus_rows", "decide_promotion", "draft_output",
           "evaluate_on_worker", "features_url", "register_draft_folder", "registry_client", "rollback",
           "run_retrain", "scale_folder", "scale_rows"]
