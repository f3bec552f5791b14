"""The captions file of data preparation: which videos to prepare, each with its caption.

Three forms, video paths relative to the videos folder (absolute ones must lie inside it):
- CSV with a header naming `video` and `caption` columns (others are ignored), e.g. `clips/a.mp4,a red car`;
- JSONL, one `{"video": "clips/a.mp4", "caption": "a red car"}` a line;
- none: every video or image file under the folder, its caption in the `.txt` file of the same name beside it.
Every problem (a missing video, an empty caption, a video listed twice) is reported at once, with the
file and line.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from parallel.prepare_data.frames import IMAGE_SUFFIXES

# what the folder scan takes: videos, and images (one-frame clips)
CLIP_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v") + IMAGE_SUFFIXES


class InputError(ValueError):
    """Input a user can fix; the message names the file (and line) and what would work."""


def _entry(videos: Path, name: str, caption, where: str) -> tuple[str, str]:
    """(video path relative to `videos`, stripped caption) for one captions line."""
    path = Path(name)
    if path.is_absolute():
        try:
            path = path.relative_to(videos.absolute())
        except ValueError:
            raise InputError(f"{where}: video {name!r} is outside --videos={videos}") from None
    rel = Path(os.path.normpath(path))
    if rel.parts[:1] == ("..",):
        raise InputError(f"{where}: video {name!r} is outside --videos={videos}")
    if not (videos / rel).is_file():
        raise InputError(f"{where}: video {videos / rel} does not exist (paths are relative to --videos)")
    if not isinstance(caption, str) or not caption.strip():
        raise InputError(f"{where}: video {name!r} has an empty caption")
    return rel.as_posix(), caption.strip()


def video_files(videos: Path) -> list[Path]:
    return sorted(p for p in videos.rglob("*") if p.suffix.lower() in CLIP_SUFFIXES and p.is_file())


def read_captions(videos: Path, captions: Path | None) -> list[tuple[str, str]]:
    """[(video path relative to `videos`, caption)] in file order; every problem listed in one InputError."""
    if not videos.is_dir():
        raise InputError(f"--videos={videos}: no such folder")
    rows, problems = [], []
    if captions is None:
        for path in video_files(videos):
            txt = path.with_suffix(".txt")
            if txt.is_file():
                rows.append((path.relative_to(videos).as_posix(), txt.read_text(encoding="utf-8"), str(txt)))
            else:
                problems.append(f"{txt}: missing; write the caption of {path.name} there, or pass --captions "
                                "FILE (CSV with video,caption columns or JSONL)")
        if not rows and not problems:
            raise InputError(f"--videos={videos}: no video or image files ({', '.join(CLIP_SUFFIXES)}) in it")
    elif not captions.is_file():
        raise InputError(f"--captions={captions}: no such file (a CSV with video,caption columns or JSONL of "
                         '{"video": ..., "caption": ...}; omit it to read a .txt next to each video)')
    elif captions.suffix.lower() == ".csv":
        with open(captions, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if not {"video", "caption"} <= set(reader.fieldnames or ()):
                raise InputError(f"--captions={captions}: the header must name columns video and caption "
                                 f"(it has {reader.fieldnames})")
            rows = [(r["video"], r["caption"], f"{captions}:{n}") for n, r in enumerate(reader, 2)]
    elif captions.suffix.lower() == ".jsonl":
        for n, line in enumerate(captions.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                    rows.append((record["video"], record["caption"], f"{captions}:{n}"))
                except (json.JSONDecodeError, KeyError, TypeError):
                    problems.append(f'{captions}:{n}: expected {{"video": "clip.mp4", "caption": "..."}}')
    else:
        raise InputError(f"--captions={captions}: unknown format; use a .csv (video,caption columns) or .jsonl")
    entries, seen = [], {}
    for name, caption, where in rows:
        try:
            entry = _entry(videos, name, caption, where)
        except InputError as e:
            problems.append(str(e))
            continue
        if entry[0] in seen:
            problems.append(f"{where}: video {name!r} is listed again (first at {seen[entry[0]]})")
        seen.setdefault(entry[0], where)
        entries.append(entry)
    if not entries and not problems:
        problems.append(f"--captions={captions}: lists no videos")
    if problems:
        more = f"\n({len(problems) - 20} more)" if len(problems) > 20 else ""
        raise InputError("\n".join(problems[:20]) + more)
    return entries
