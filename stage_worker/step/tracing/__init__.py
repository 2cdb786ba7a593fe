"""How a decode step's layers run compiled: the split mixers and the switch (`compiled`), one trace
per layer boundary (`decode_chain`), and on a GPU the whole step as one trace (`whole_step`)."""
