"""The leaf the three parts share (DESIGN.md): it imports nothing of `sisrl.retriever`, `sisrl.services` or
`sisrl.trainer`."""
