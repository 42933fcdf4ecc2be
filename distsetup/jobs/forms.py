"""The forms the Kubernetes API server holds names and sizes to (k8s.io/apimachinery's validation and
resource.Quantity), each written once: the schemas check a file's fields with them, `distsetup job` its flags."""

import re
from dataclasses import dataclass

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_LABEL}(\.{_LABEL})*"


@dataclass(frozen=True)
class Form:
    """A string's form: a regular expression it matches whole, at most `max_length` characters, and how to say it."""

    pattern: str
    max_length: int
    said: str  # "a DNS label (...)": what the value must be
    example: str

    def fits(self, value: str) -> bool:
        return len(value) <= self.max_length and re.fullmatch(self.pattern, value) is not None

    def schema(self) -> dict:
        """The JSON Schema of a string of this form; `description` is what a problem says (formats/problems.py)."""
        return {
            "type": "string",
            "pattern": f"^{self.pattern}$",
            "maxLength": self.max_length,
            "description": self.said,
        }

    def problem(self, flag: str, value: str | None) -> tuple[str, str] | None:
        """(what is wrong, the fix) with `flag`'s `value` (None: not given), or None."""
        if value is None or self.fits(value):
            return None
        return f"{flag} {value!r} is not {self.said}.", f"e.g. {flag} {self.example}."


DNS_LABEL = Form(_LABEL, 63, "a DNS label (at most 63 lower-case letters, digits and '-')", "team-a")
DNS_SUBDOMAIN = Form(
    _SUBDOMAIN, 253, "a DNS subdomain (lower-case letters, digits, '-' and '.', at most 253)", "shared-runs"
)
# A resource's name: an optional DNS-subdomain prefix and '/', then a name of letters, digits, '-', '_' and '.'
RESOURCE_NAME = Form(
    rf"({_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
    253 + 1 + 63,
    "a resource name (e.g. nvidia.com/gpu: a domain, '/', letters, digits, '-', '_' and '.')",
    "amd.com/gpu",
)
QUANTITY = Form(
    r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?",
    64,
    "a quantity (a number and a unit such as Gi, G or M, with no space)",
    "16Gi",
)
