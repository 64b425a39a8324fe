"""sisrl.retriever."""
