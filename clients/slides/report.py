"""The end of a `--tiled` run over several slides: each slide complete, incomplete (tiles that could not be read)
or failed (refused before its first tile), so one bad slide is named while the others are scored."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from clients.slides.run import SlideSummary

__all__ = ["SlideOutcome", "RunReport"]


@dataclass
class SlideOutcome:
    path: str
    status: str  # "complete", "incomplete" or "failed"
    tiles: int = 0
    failed_tiles: int = 0
    error: str = ""  # why it failed, or its first failed tile's error
    map: str = ""


@dataclass
class RunReport:
    slides: list[SlideOutcome] = field(default_factory=list)

    def scored(self, path: str | Path, summary: SlideSummary) -> None:
        first = next(iter(sorted(summary.failed.items())), None)
        self.slides.append(SlideOutcome(str(path), "complete" if summary.complete else "incomplete", summary.tiles,
                                        len(summary.failed), first[1] if first else "", str(summary.map_path)))

    def failed(self, path: str | Path, error: Exception) -> None:
        self.slides.append(SlideOutcome(str(path), "failed", error=str(error)))

    @property
    def all_complete(self) -> bool:
        return all(slide.status == "complete" for slide in self.slides)

    def table(self) -> str:
        counts = {status: sum(slide.status == status for slide in self.slides)
                  for status in ("complete", "incomplete", "failed")}
        lines = [f"slides {len(self.slides)}: " + ", ".join(f"{count} {status}" for status, count in counts.items())]
        for slide in self.slides:
            if slide.status == "failed":
                lines.append(f"  failed: {slide.error}")
            elif slide.status == "incomplete":
                lines.append(f"  incomplete: {slide.path}: {slide.failed_tiles} of {slide.tiles} tiles could not be "
                             f"read (their cells are NaN in {slide.map}; --retry-failed tries them again), "
                             f"e.g. {slide.error}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"slides": [asdict(slide) for slide in self.slides]}
