"""The dataset of ``my_qa.yaml``: ``my_qa.jsonl`` beside this file, read with the datasets
library's JSON loader, whatever folder lm-eval runs in (``custom_dataset: !function
my_qa_data.load`` in the YAML; lm-eval imports this file from the YAML's folder)."""

from pathlib import Path


def load(**kwargs):
    """``{"test": Dataset}`` of the JSONL file beside this one (lm-eval passes the task's
    metadata as keyword arguments; none is needed)."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("my_qa.jsonl"))})
