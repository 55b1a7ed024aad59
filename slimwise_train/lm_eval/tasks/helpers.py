# lm-eval loads `!function helpers.<name>` from this file by path; the implementations live in the package.
from slimwise_train.lm_eval.scoring import (  # noqa: F401
    gsm8k_process_results,
    humaneval_process_results,
    load_family,
    local_rows,
    math500_doc_to_text,
    math500_process_results,
    synthetic_doc_to_target,
    synthetic_doc_to_text,
    synthetic_process_results,
)
