"""`fastdecode transcribe`: speech files to text, SubRip, WebVTT or JSON with a Whisper model."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import AudioError, InvalidOptionError
from .errors import handle_errors, require_stream

SUFFIX_FORMATS = {".srt": "srt", ".vtt": "vtt", ".txt": "text", ".json": "verbose_json"}
FORMAT_SUFFIXES = {"srt": ".srt", "vtt": ".vtt", "text": ".txt", "verbose_json": ".json", "json": ".json"}


@click.command("transcribe")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--model", "-m", required=True, help="A Whisper folder (CTranslate2 model.bin or HF safetensors).")
@click.option("--output", "-o", default=None,
              help="Output file (one input; its suffix picks the format: .srt .vtt .txt .json) or folder "
                   "(several inputs). Default: the text with times on stdout.")
@click.option("--format", "response_format", type=click.Choice(["text", "srt", "vtt", "json", "verbose_json"]),
              default=None, help="Output format (default: from the -o suffix, else srt in a folder; without -o, the segments "
                   "with their times).")
@click.option("--language", default=None, help="Language code (default: detected from the first 30 s).")
@click.option("--task", type=click.Choice(["transcribe", "translate"]), default="transcribe", show_default=True)
@click.option("--beam-size", type=int, default=5, show_default=True)
@click.option("--temperature", type=float, multiple=True,
              help="Temperature(s) to fall back through (default 0 0.2 0.4 0.6 0.8 1).")
@click.option("--initial-prompt", default=None, help="Text that the first window continues (names, spelling).")
@click.option("--without-timestamps", is_flag=True, help="One segment per 30 s window, no timestamp tokens.")
@click.option("--word-timestamps", is_flag=True,
              help="Each word's start and end (verbose_json: 'words'), from the alignment heads.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="A progress bar on stderr.")
@click.option("--quantize", type=click.Choice(["int8", "int4"]), default=None,
              help="Quantize the weights at load (default: float32).")
@handle_errors
def transcribe(files: tuple[str, ...], model: str, output: str | None, response_format: str | None,
               language: str | None, task: str, beam_size: int, temperature: tuple[float, ...],
               initial_prompt: str | None, without_timestamps: bool, word_timestamps: bool, progress: bool,
               quantize: str | None) -> None:
    """Transcribe (or translate into English) speech files with a Whisper model."""
    from .. import load_speech
    from ..speech.formats import render

    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise AudioError(f"audio file {missing[0]} does not exist")
    targets = _targets(files, output, response_format)
    if output is None:
        require_stream("stdout")
    speech = load_speech(model, quantize=quantize)
    options = {"initial_prompt": initial_prompt, "without_timestamps": without_timestamps,
               "word_timestamps": word_timestamps}
    if temperature:
        options["temperature"] = tuple(temperature)
    for file, (target, fmt) in zip(files, targets):
        with _progress_bar(file, progress) as advance:
            result = speech.transcribe(file, language=language, task=task, beam_size=beam_size, progress=advance,
                                       **options)
        if target is None and fmt is not None:  # --format without -o: that format on stdout
            rendered = render(result, fmt)
            click.echo(rendered, nl=not rendered.endswith("\n"))
            continue
        if target is None:
            for s in result.segments:
                click.echo(f"[{s.start:8.2f} -> {s.end:8.2f}] {s.text.strip()}")
            continue
        try:
            target.write_text(render(result, fmt), encoding="utf-8")
        except OSError as exc:
            raise InvalidOptionError(f"cannot write {target}: {exc.strerror or exc}") from exc


def _targets(files, output, response_format) -> list[tuple[Path | None, str]]:
    """Each input's output file (None: stdout) and format (None: stdout's listing of segments with times)."""
    if output is None:
        return [(None, response_format)] * len(files)
    path = Path(output)
    if len(files) > 1 or path.is_dir():
        if path.exists() and not path.is_dir():
            raise InvalidOptionError(f"-o {output}: with several inputs it must be a folder")
        path.mkdir(parents=True, exist_ok=True)
        fmt = response_format or "srt"
        return [(path / (Path(f).stem + FORMAT_SUFFIXES[fmt]), fmt) for f in files]
    fmt = response_format or SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InvalidOptionError(f"-o {output}: cannot tell the format from its suffix; give --format "
                                 f"or one of {', '.join(SUFFIX_FORMATS)}")
    return [(path, fmt)]


class _progress_bar:
    """A tqdm bar over the file's seconds (its total unknown while streaming: seconds done shown)."""

    def __init__(self, file: str, enabled: bool):
        self.file, self.enabled, self.bar = file, enabled, None

    def __enter__(self):
        if not self.enabled:
            return None
        from tqdm import tqdm

        self.bar = tqdm(desc=Path(self.file).name, unit="s", unit_scale=False, leave=True,
                        bar_format="{desc}: {n:.1f} s of audio [{elapsed}, {rate_fmt}]")
        return self._advance

    def _advance(self, seconds: float) -> None:
        self.bar.update(seconds - self.bar.n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False
