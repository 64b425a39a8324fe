"""The leaf the three parts share (docs/design.md, "Parts"): it imports nothing of `sisrl.retriever`,
`sisrl.services` or `sisrl.trainer`."""
