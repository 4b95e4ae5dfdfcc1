"""What a model argument names: a Hub file (USER/REPO/FILE.gguf) or a plain URL.

Only the syntax is decided here; whether a string is rather an existing path or a cached name
is the caller's question (pull.resolve asks it first)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

# the Hub's repo-id rule for each half: letters, digits, '-', '_', '.'; no leading '-' or '.'
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_HUB = re.compile(rf"({_PART})/({_PART})/(.+\.gguf)", re.IGNORECASE)
# a Hub web address for a file: .../USER/REPO/resolve/REV/FILE (or blob/, the HTML page)
_HUB_URL = re.compile(rf"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/({_PART})/({_PART})/"
                      r"(?:resolve|blob)/([^/]+)/(.+\.gguf)", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # "USER/REPO"
    filename: str  # a path inside the repository: "FILE.gguf" or "DIR/FILE.gguf"
    revision: str | None = None  # None: the default branch

    @property
    def name(self) -> str:
        """The name `slipstream list` shows, and `-m` and `rm` accept."""
        return f"{self.repo_id}/{self.filename}"

    def __str__(self) -> str:
        return self.name + (f" (revision {self.revision})" if self.revision else "")


@dataclass(frozen=True)
class UrlRef:
    url: str

    @property
    def host(self) -> str:
        """HOST[:PORT], without any user:password@ (not to be written into a path)."""
        return urlsplit(self.url).netloc.rpartition("@")[2]

    @property
    def parts(self) -> tuple[str, ...]:
        """The URL's path segments, percent-decoded, empty ones dropped. Not checked here: a
        decoded segment may be '..' or hold a '/'; store.url_path refuses those."""
        return tuple(p for p in (unquote(s) for s in urlsplit(self.url).path.split("/")) if p)

    @property
    def filename(self) -> str:
        return self.parts[-1] if self.parts else "model.gguf"

    def __str__(self) -> str:
        return self.url


def parse_ref(text: str) -> HubRef | UrlRef | None:
    """A HubRef for USER/REPO/FILE.gguf or a Hub file's web address, a UrlRef for any other
    http(s) URL, None for anything else. A leading '/', './', '../' or '~' marks a path."""
    if m := _HUB_URL.fullmatch(text):
        user, repo, rev, filename = m.groups()
        return HubRef(f"{user}/{repo}", unquote(filename), None if rev == "main" else rev)
    if re.match(r"https?://", text, re.IGNORECASE):
        return UrlRef(text)
    if text.startswith(("/", "./", "../", "~")) or "\\" in text:
        return None
    if m := _HUB.fullmatch(text):
        user, repo, filename = m.groups()
        if ".." not in filename.split("/"):
            return HubRef(f"{user}/{repo}", filename)
    return None
