"""What a micro-batch's loss is (`objective.py`: token data against the model's logits, `token_objective.py`, or
the user's own loss, `python_objective.py`, each returning a `micro_loss.MicroLoss`; what an error at its first step
says, `first_step_errors.py`), and the cross-entropy computed a slice of the vocabulary at a time so the logits never
exist whole (`sliced.py`).

May import: the training layer's base modules, model/ and data/ (the ignored target id, loss weights).
"""
