"""Where an image's rows sit in the prompt: the text each family's Hugging Face processor puts
around them (Gemma3Processor's full_image_sequence, Idefics3Processor's replace_image_token;
LLaVA's processor puts none), as text pieces to tokenize and runs of rows."""
from __future__ import annotations

_FAKE, _GLOBAL = "<fake_token_around_image>", "<global-img>"
_AROUND = {"mlp": ("", ""), "gemma3": ("\n\n<start_of_image>", "<end_of_image>\n\n"),
           "idefics3": (f"{_FAKE}{_GLOBAL}", _FAKE)}


def image_layout(projector: str, rows_per_frame: int, grid: tuple[int, int]) -> list[str | int]:
    """Text pieces and row counts in prompt order; `grid`: idefics3's tiles (rows, cols), each
    a frame of `rows_per_frame` rows before the whole image's; (0, 0) for one frame."""
    parts: list[str | int] = []
    for r in range(grid[0]):
        for c in range(grid[1]):
            parts += [f"{_FAKE}<row_{r + 1}_col_{c + 1}>", rows_per_frame]
        parts.append("\n")
    before, after = _AROUND[projector]
    parts += ["\n" + before if grid[0] else before, rows_per_frame, after]
    return _merged(parts)


def _merged(parts: list[str | int]) -> list[str | int]:
    """Adjacent text pieces joined (the tokenizer sees them as one), empty ones dropped."""
    out: list[str | int] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return out
