"""Write docs/api-reference.md from the compiled descriptors of protos/*.proto: `python docs/gen_api.py`.

The .proto files are compiled as protos/generate.py compiles the stubs (as braid/protos/*.proto, with
grpc_tools' own include path), here with `--include_source_info --descriptor_set_out`, so the page is rendered
from what protoc parsed: every service and RPC (request and response types, streaming), every message (fields,
types, labels, oneofs) and enum (values), each with the comments the .proto source puts on it. The output depends
on the .proto files alone. `--check` writes nothing and exits 1 when the committed page differs from what would be
written (tests/docs/test_docs.py runs it).
"""

import argparse
import os
import re
import shutil
import sys
import tempfile

from google.protobuf import descriptor_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOS = os.path.join(ROOT, "protos")
OUT = os.path.join(ROOT, "docs", "api-reference.md")
PACKAGE_DIR = "braid/protos"  # where the stubs compile them (protos/generate.py), so their imports match

# FileDescriptorProto / DescriptorProto / ... field numbers, as SourceCodeInfo paths name them
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {number: name.removeprefix("TYPE_").lower()
           for name, number in F.Type.items() if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")}


def proto_files() -> list[str]:
    return sorted(f for f in os.listdir(PROTOS) if f.endswith(".proto"))


def compile_descriptors() -> descriptor_pb2.FileDescriptorSet:
    """protos/*.proto compiled by grpc_tools.protoc, with source info (comments and locations)."""
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    with tempfile.TemporaryDirectory() as src:
        package = os.path.join(src, *PACKAGE_DIR.split("/"))
        os.makedirs(package)
        for name in proto_files():
            shutil.copy(os.path.join(PROTOS, name), package)
        out = os.path.join(src, "descriptors.pb")
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{include}", "--include_source_info",
                f"--descriptor_set_out={out}"] + [f"{PACKAGE_DIR}/{name}" for name in proto_files()]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        with open(out, "rb") as f:
            return descriptor_pb2.FileDescriptorSet.FromString(f.read())


class Comments:
    """The comments protoc recorded for each element of one file (SourceCodeInfo), with one repair from the source.

    protoc gives a trailing comment only the line it starts on. A comment continued on the lines below, its `//`
    aligned with the first line's, is either given to the next element as its leading comment or dropped (before
    a closing brace). Those lines are read back from the .proto source here and put back where they belong."""

    def __init__(self, f: descriptor_pb2.FileDescriptorProto, source: list[str]):
        self.locations = {tuple(loc.path): loc for loc in f.source_code_info.location}
        self.continued: dict[tuple[int, ...], list[str]] = {}
        consumed: set[int] = set()
        for path, loc in self.locations.items():
            if not loc.trailing_comments.strip() or not path:
                continue
            end = loc.span[2] if len(loc.span) == 4 else loc.span[0]
            column = source[end].find("//", loc.span[-1])
            lines, n = [], end + 1
            while column >= 0 and n < len(source) and source[n].find("//") == column \
                    and not source[n][:column].strip():
                lines.append(source[n][column + 2:].strip())
                consumed.add(n)
                n += 1
            if lines:
                self.continued[path] = lines
        # leading comments that are such continuations (every line of them consumed above) belong to no one here
        self.borrowed = set()
        for path, loc in self.locations.items():
            k = loc.leading_comments.count("\n")
            if loc.leading_comments.strip() and k and all(line in consumed for line in range(loc.span[0] - k,
                                                                                             loc.span[0])):
                self.borrowed.add(path)

    def __call__(self, path: tuple[int, ...]) -> str:
        """The element's leading and trailing comments, as one paragraph."""
        loc = self.locations.get(path)
        if loc is None:
            return ""
        parts = [] if path in self.borrowed else [loc.leading_comments]
        parts += [loc.trailing_comments, "\n".join(self.continued.get(path, ()))]
        return " ".join(" ".join(line.strip() for line in p.strip().splitlines()) for p in parts if p.strip())


def escape(text: str, table: bool = False) -> str:
    """Markdown-safe text: characters Markdown would read as markup (or HTML) are escaped outside `code spans`
    (in a table cell, a pipe too; the tables extension leaves pipes inside code spans alone)."""
    pieces = re.split(r"(`[^`]*`)", text)
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            piece = piece.replace("\\", "\\\\")
            for ch in "*_[]" + ("|" if table else ""):
                piece = piece.replace(ch, "\\" + ch)
            piece = piece.replace("<", "&lt;").replace(">", "&gt;")
        pieces[i] = piece
    return "".join(pieces)


def relative(full_name: str, package: str) -> str:
    """A type's name within its package: ".braid.v1.Outer.Inner" -> "Outer.Inner"."""
    return full_name.removeprefix(f".{package}.") if package else full_name.lstrip(".")


def anchor(full_name: str) -> str:
    """The heading id of a type: its full name with dots as hyphens (braid.v1.Sampling -> braid-v1-Sampling)."""
    return full_name.strip(".").replace(".", "-")


class Renderer:
    def __init__(self, files: descriptor_pb2.FileDescriptorSet):
        self.files = sorted(files.file, key=lambda f: f.name)
        # every message and enum declared in these files, by full name (".braid.v1.Sampling"), and the map entries
        self.types: set[str] = set()
        self.maps: dict[str, descriptor_pb2.DescriptorProto] = {}
        for f in self.files:
            for name, msg, _ in self._messages(f.message_type, f".{f.package}" if f.package else ""):
                if msg.options.map_entry:
                    self.maps[name] = msg
                else:
                    self.types.add(name)
            for name, _, _ in self._enums(f):
                self.types.add(name)

    @classmethod
    def _messages(cls, messages, scope: str, path: tuple[int, ...] = (FILE_MESSAGE,)):
        """(full name, message, source path) of every message, nested ones after their parent, in source order."""
        for i, msg in enumerate(messages):
            name = f"{scope}.{msg.name}"
            yield name, msg, path + (i,)
            yield from cls._messages(msg.nested_type, name, path + (i, MESSAGE_NESTED))

    @classmethod
    def _enums(cls, f: descriptor_pb2.FileDescriptorProto):
        """(full name, enum, source path) of every enum: the file's, then each message's, in source order."""
        scope = f".{f.package}" if f.package else ""
        for i, enum in enumerate(f.enum_type):
            yield f"{scope}.{enum.name}", enum, (FILE_ENUM, i)
        for name, msg, path in cls._messages(f.message_type, scope):
            for i, enum in enumerate(msg.enum_type):
                yield f"{name}.{enum.name}", enum, path + (MESSAGE_ENUM, i)

    def type_ref(self, type_name: str) -> str:
        """A message or enum type as a link to its heading (or its plain name, if it is not on this page)."""
        short = type_name.rsplit(".", 1)[-1]
        if type_name in self.types:
            return f"[`{short}`](#{anchor(type_name)})"
        return f"`{type_name.strip('.')}`"

    def field_type(self, field: descriptor_pb2.FieldDescriptorProto) -> str:
        if field.type_name in self.maps:
            key, value = self.maps[field.type_name].field
            return f"map<{self.field_type(key)}, {self.field_type(value)}>".replace("<", "&lt;").replace(">", "&gt;")
        if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM, F.TYPE_GROUP):
            return self.type_ref(field.type_name)
        return f"`{SCALARS[field.type]}`"

    @staticmethod
    def label(msg: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto,
              maps: dict) -> str:
        if field.type_name in maps:
            return ""
        if field.proto3_optional:
            return "optional"
        if field.label == F.LABEL_REPEATED:
            return "repeated"
        if field.HasField("oneof_index"):
            return f"oneof `{msg.oneof_decl[field.oneof_index].name}`"
        if field.label == F.LABEL_REQUIRED:
            return "required"
        return ""

    def render(self) -> str:
        names = ", ".join(f"`protos/{os.path.basename(f.name)}`" for f in self.files)
        out = ["# API reference", "",
               "<!-- Generated by `python docs/gen_api.py` from the compiled .proto descriptors: do not edit. -->", "",
               (f"Every service, RPC, message and enum of {names}, with the comments of the .proto source. "
                "The agent API is `braid.v1.AgentService`; [The agent API](api.md) explains it in prose. "
                "`KVTransfer` and `KVExport` are the replicas' internal ports: they take calls from the cluster's "
                "own replicas only."), ""]
        for f in self.files:
            out += self.render_file(f)
        return "\n".join(out).rstrip("\n") + "\n"

    def render_file(self, f: descriptor_pb2.FileDescriptorProto) -> list[str]:
        with open(os.path.join(PROTOS, os.path.basename(f.name)), encoding="utf-8") as src:
            locations = Comments(f, src.read().splitlines())
        out = [f"## `{os.path.basename(f.name)}`", "", f"Package `{f.package}`.", ""]
        if f.service:
            out += ["### Services", ""]
            for i, service in enumerate(f.service):
                out += self.render_service(f, service, locations, (FILE_SERVICE, i))
        messages = [(n, m, p) for n, m, p in self._messages(f.message_type, f".{f.package}" if f.package else "")
                    if not m.options.map_entry]
        if messages:
            out += ["### Messages", ""]
            for name, msg, path in messages:
                out += self.render_message(name, relative(name, f.package), msg, locations, path)
        enums = list(self._enums(f))
        if enums:
            out += ["### Enums", ""]
            for name, enum, path in enums:
                out += self.render_enum(name, relative(name, f.package), enum, locations, path)
        return out

    def render_service(self, f, service, locations, path) -> list[str]:
        full = f"{f.package}.{service.name}" if f.package else service.name
        out = [f"#### {service.name} {{ #{anchor(full)} }}", "", f"`{full}`", ""]
        text = locations(path)
        if text:
            out += [escape(text), ""]
        out += ["| RPC | request | response | description |", "|---|---|---|---|"]
        for j, method in enumerate(service.method):
            request = ("stream " if method.client_streaming else "") + self.type_ref(method.input_type)
            response = ("stream " if method.server_streaming else "") + self.type_ref(method.output_type)
            note = escape(locations(path + (SERVICE_METHOD, j)), table=True)
            out.append(f"| `{method.name}` | {request} | {response} | {note} |")
        return out + [""]

    def render_message(self, name, title, msg, locations, path) -> list[str]:
        out = [f"#### {title} {{ #{anchor(name)} }}", ""]
        text = locations(path)
        if text:
            out += [escape(text), ""]
        if not msg.field:
            return out + ["No fields.", ""]
        out += ["| field | number | type | label | description |", "|---|---|---|---|---|"]
        for j, field in enumerate(msg.field):
            note = escape(locations(path + (MESSAGE_FIELD, j)), table=True)
            out.append(f"| `{field.name}` | {field.number} | {self.field_type(field)} | "
                       f"{self.label(msg, field, self.maps)} | {note} |")
        return out + [""]

    def render_enum(self, name, title, enum, locations, path) -> list[str]:
        out = [f"#### {title} {{ #{anchor(name)} }}", ""]
        text = locations(path)
        if text:
            out += [escape(text), ""]
        out += ["| value | number | description |", "|---|---|---|"]
        for j, value in enumerate(enum.value):
            note = escape(locations(path + (ENUM_VALUE, j)), table=True)
            out.append(f"| `{value.name}` | {value.number} | {note} |")
        return out + [""]


def generate() -> str:
    return Renderer(compile_descriptors()).render()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when docs/api-reference.md differs from what would be written")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        try:
            with open(OUT, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{os.path.relpath(OUT, ROOT)} is {'missing' if current is None else 'stale'}: "
                  "run `python docs/gen_api.py`", file=sys.stderr)
            return 1
        print(f"{os.path.relpath(OUT, ROOT)} is up to date")
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
