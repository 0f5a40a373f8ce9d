"""Code several tools share (prompts, engine runs, the step clock); no scripts here."""
