"""The forms the Kubernetes API server holds names and sizes to (k8s.io/apimachinery's validation and
resource.Quantity), each written once: the schemas check a file's fields with them, `distsetup job` its flags."""

import re
from dataclasses import dataclass

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_LABEL}(\.{_LABEL})*"
_RESOURCE = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"  # a resource's own name, at most 63 characters


@dataclass(frozen=True)
class Form:
    """A string's form: a regular expression it matches whole, at most `max_length` characters, and how to say it."""

    pattern: str
    max_length: int
    said: str  # "a DNS label (...)": what the value must be
    example: str

    def fits(self, value: str) -> bool:
        return len(value) <= self.max_length and re.fullmatch(self.pattern, value) is not None

    def schema(self, or_empty: bool = False) -> dict:
        """The JSON Schema of a string of this form (`or_empty`: or ""); its `description` and `examples` are what
        a problem says (formats/problems.py). The pattern ends at the string's end, not before a final newline."""
        pattern = f"(?:{self.pattern})?" if or_empty else f"(?:{self.pattern})"
        return {
            "type": "string",
            "pattern": f"^{pattern}(?![\\s\\S])",
            "maxLength": self.max_length,
            "description": self.said,
            "examples": [self.example],
        }

    def problem(self, flag: str, value: str | None) -> tuple[str, str] | None:
        """(what is wrong, the fix) with `flag`'s `value` (None: not given), or None."""
        if value is None or self.fits(value):
            return None
        return f"{flag} {value!r} is not {self.said}.", f"e.g. {flag} {self.example}."


DNS_LABEL = Form(_LABEL, 63, "a DNS label (at most 63 lower-case letters, digits and '-')", "team-a")
# An object name that must also start with a letter (RFC 1035): TrainJob's CEL rule, the operators' webhooks
DNS_1035_LABEL = Form(
    r"[a-z]([-a-z0-9]*[a-z0-9])?",
    63,
    "a DNS label (at most 63 lower-case letters, digits and '-', starting with a letter, ending with a letter or "
    "digit)",
    "llm-run-1",
)
DNS_SUBDOMAIN = Form(
    _SUBDOMAIN, 253, "a DNS subdomain (lower-case letters, digits, '-' and '.', at most 253)", "shared-runs"
)
# A container's resource: a standard one (cpu, memory) or an extended one, DOMAIN/NAME
RESOURCE_NAME = Form(
    rf"({_SUBDOMAIN}/)?{_RESOURCE}", 253 + 1 + 63, "a resource name (cpu, memory, or a domain, '/' and a name)", "cpu"
)
# What GPUs are asked for as: an extended resource, outside the kubernetes.io domain and not a quota's requests.
GPU_RESOURCE = Form(
    rf"(?!requests\.)(?!([^/]*\.)?kubernetes\.io/){_SUBDOMAIN}/{_RESOURCE}",
    253 + 1 + 63,
    "an extended resource name (a domain other than kubernetes.io, '/' and a name, e.g. nvidia.com/gpu)",
    "amd.com/gpu",
)
# A container image reference (the distribution project's reference grammar, which the kubelet parses): a registry
# host (any case, a port) and a path of lower-case components, then a tag and/or a digest. A space or a capital in
# the path: the API server or the kubelet (InvalidImageName) refuses it, after the job was submitted.
_DOMAIN = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*"
_HOST = rf"({_DOMAIN}|\[[a-fA-F0-9:]+\])(:[0-9]+)?"  # a name or an IPv6 address in brackets, and a port
_PATH = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*"
IMAGE = Form(  # the name at most 255 characters (checked up to its first ':' or '@')
    rf"(?=[^:@]{{1,255}}([:@]|$))({_HOST}/)?{_PATH}(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?",
    4096,
    "an image reference (REGISTRY/PATH:TAG, the path in lower case, no spaces)",
    "ghcr.io/me/train:1.0",
)
# A size a flag gives: more than zero bytes, with a unit of bytes (Kubernetes reads a bare 16 as 16 bytes, and 512m
# as 0.512 of one)
SIZE = Form(
    r"(?![0.]*[KMGTPEk])([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE])",
    64,
    "a size in bytes: a number and a unit such as Gi, G or Mi, with no space",
    "16Gi",
)
# A size: a number and a unit (Quantity's, without the sign a size cannot have)
QUANTITY = Form(
    r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?",
    64,
    "a quantity (a number and a unit such as Gi, G or M, with no space)",
    "16Gi",
)
