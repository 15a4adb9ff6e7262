"""What the package reads of a target as mlx-lm builds it: the language model inside (a
multimodal model holds one), and that model's args.  Below the drafter's checkpoint checks,
the loop's target, the distributed splits and training, which all read them."""


def text_model(model):
    """The language model inside a (possibly multimodal) mlx-lm model."""
    return getattr(model, "language_model", model)


def model_args(model):
    tm = text_model(model)
    return getattr(tm, "args", None) or getattr(model, "args")
