#!/usr/bin/python3
"""Writes client/python/kvshade/_native_abi.py, the ctypes declarations of the C ABI, from
client/include/kvshade/kvshade.h: its integer #defines and enum values as constants, each
struct with a body as a ctypes.Structure, and each KVSHADE_API function's restype and
argtypes. kvshade/_native.py loads the library with them, so a change of the header reaches
the Python package by running this again (tests/python/test_native_gen.py fails while the
checked-in file differs from what this writes).

  /usr/bin/python3 scripts/gen_native.py            # rewrite the module
  /usr/bin/python3 scripts/gen_native.py --check    # exit 1 if it is stale
  /usr/bin/python3 scripts/gen_native.py -o FILE    # write FILE instead

The parser knows the header's own conventions, not C at large: top-level declarations end
in `;`; the only preprocessor lines are the include guard, `#include`, the __cplusplus and
__GNUC__ conditionals, `#define KVSHADE_API` and `#define NAME <integer>`; types are the
fixed-width integers, size_t, int, char, float, double, void and the header's own
kvshade_* typedefs, with `const` and `*`; every parameter is named. Anything else stops the
generator with the line it could not read. Standard library only.

Types: `const char*` is ctypes.c_char_p (a NUL-terminated string in or out), `char*` a
buffer written to (POINTER(c_char)); `void*` and pointers to opaque handles
(typedef struct X X; without a body) are c_void_p; a pointer to a struct, scalar or
pointer is POINTER of it (device memory passed as such a pointer: ctypes.cast its address).
"""
import argparse
import difflib
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HEADER = os.path.join(ROOT, "client", "include", "kvshade", "kvshade.h")
OUTPUT = os.path.join(ROOT, "client", "python", "kvshade", "_native_abi.py")

SCALARS = {
    "int": "ctypes.c_int",
    "char": "ctypes.c_char",
    "float": "ctypes.c_float",
    "double": "ctypes.c_double",
    "size_t": "ctypes.c_size_t",
    "int8_t": "ctypes.c_int8",
    "uint8_t": "ctypes.c_uint8",
    "int16_t": "ctypes.c_int16",
    "uint16_t": "ctypes.c_uint16",
    "int32_t": "ctypes.c_int32",
    "uint32_t": "ctypes.c_uint32",
    "int64_t": "ctypes.c_int64",
    "uint64_t": "ctypes.c_uint64",
}

# Preprocessor conditionals, as a C compiler (not C++) sees them.
CONDITIONALS = {
    "#ifndef KVSHADE_KVSHADE_H_": True,
    "#ifdef __cplusplus": False,
    "#if defined(__GNUC__)": True,
}

# The include guard and the export macro: nothing for ctypes.
IGNORED_DEFINES = {
    "#define KVSHADE_KVSHADE_H_",
    "#define KVSHADE_API",
    '#define KVSHADE_API __attribute__((visibility("default")))',
}

INT_RE = r"(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*"


class ParseError(Exception):
    pass


class Header:
    def __init__(self):
        self.constants = []   # (line number, name, int value); sorted by line once parsed
        self.structs = []     # (C name, [(field name, ctype expression, C declaration)])
        self.opaque = set()   # typedef struct X X; without a body
        self.functions = []   # (name, (restype, C return type), [(param name, ctype, C type)])


def strip_comments(text):
    """Comments become spaces (newlines kept, so that line numbers stay right)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    text = re.sub(r"/\*.*?\*/", blank, text, flags=re.S)
    if "/*" in text:
        raise ParseError("an unterminated /* comment")
    return re.sub(r"//[^\n]*", blank, text)


def preprocess(text, header):
    """Takes the #defines, drops what a C compiler would skip; returns [(line number, text)]."""
    out, stack = [], []
    for no, line in enumerate(text.split("\n"), 1):
        s = line.strip()
        if s.endswith("\\"):
            raise ParseError("line %d: a continued line" % no)
        if not s.startswith("#"):
            if all(stack):
                out.append((no, line))
            continue
        s = re.sub(r"\s+", " ", s)
        if s in CONDITIONALS:
            stack.append(CONDITIONALS[s])
        elif s == "#else":
            if not stack:
                raise ParseError("line %d: #else without #if" % no)
            stack[-1] = not stack[-1]
        elif s == "#endif":
            if not stack:
                raise ParseError("line %d: #endif without #if" % no)
            stack.pop()
        elif not all(stack):
            continue
        elif re.fullmatch(r"#include <\w+\.h>", s) or s in IGNORED_DEFINES:
            continue
        else:
            m = re.fullmatch(r"#define (KVSHADE_\w+) " + INT_RE, s)
            if not m:
                raise ParseError("line %d: a preprocessor line this generator does not know: %s" % (no, s))
            header.constants.append((no, m.group(1), int(m.group(2), 0)))
    if stack:
        raise ParseError("an #if without #endif")
    return out


def statements(lines):
    """Top-level declarations: (line number, text up to its `;`), braces balanced."""
    out, buf, start, depth = [], [], None, 0
    for no, line in lines:
        for ch in line + "\n":
            if start is None and not ch.isspace():
                start = no
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth < 0:
                    raise ParseError("line %d: unbalanced }" % no)
            if ch == ";" and depth == 0:
                out.append((start, re.sub(r"\s+", " ", "".join(buf)).strip()))
                buf, start = [], None
            else:
                buf.append(ch)
    if "".join(buf).strip():
        raise ParseError("line %d: a declaration without its ;" % start)
    return out


def py_name(c_name):
    """kvshade_client_options -> ClientOptions."""
    return "".join(w.capitalize() for w in c_name[len("kvshade_"):].split("_"))


def parse_type(text, header, no, where):
    """`const char* const*` -> (base, pointer depth, const pointee); checks the base."""
    tokens = re.findall(r"\w+|\*|\S", text)
    if any(t not in ("*", "const") and not re.fullmatch(r"\w+", t) for t in tokens):
        raise ParseError("line %d: %s: cannot read the type %r" % (no, where, text))
    words = [t for t in tokens if t not in ("*", "const")]
    depth = tokens.count("*")
    if len(words) != 1:
        raise ParseError("line %d: %s: cannot read the type %r" % (no, where, text))
    base = words[0]
    first_star = tokens.index("*") if depth else len(tokens)
    const = "const" in tokens[:first_star]
    known = base in SCALARS or base == "void" or base in header.opaque or base in dict(header.structs)
    if not known:
        raise ParseError("line %d: %s: unknown type %r" % (no, where, base))
    return base, depth, const


def ctype(base, depth, const, header, no, where, ret=False):
    if depth == 0:
        if base == "void":
            if ret:
                return "None"
            raise ParseError("line %d: %s: a void value" % (no, where))
        if base in header.opaque:
            raise ParseError("line %d: %s: an opaque type by value" % (no, where))
        if base in SCALARS:
            return SCALARS[base]
        if ret:
            raise ParseError("line %d: %s: a struct returned by value" % (no, where))
        return py_name(base)
    if depth == 1:
        if base == "char":
            inner = "ctypes.c_char_p" if const else "ctypes.POINTER(ctypes.c_char)"
        elif base == "void" or base in header.opaque:
            inner = "ctypes.c_void_p"
        else:
            inner = "ctypes.POINTER(%s)" % ctype(base, 0, const, header, no, where)
        return inner
    return "ctypes.POINTER(%s)" % ctype(base, depth - 1, const, header, no, where)


def parse_enum(body, header, no):
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(KVSHADE_\w+) = " + INT_RE, item)
        if not m:
            raise ParseError("line %d: an enumerator without an explicit integer value: %r" % (no, item))
        header.constants.append((no, m.group(1), int(m.group(2), 0)))


def parse_struct(name, body, header, no):
    consts = {name: value for _, name, value in header.constants}
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        # "uint32_t a, b" declares two fields of one type; `*` belongs to the type here.
        m = re.fullmatch(r"((?:const )?\w+(?: ?\*(?: ?const)?)*)(?: |(?<=\*))"
                         r"(\w+ ?(?:\[\w+\])?(?: ?, ?\w+ ?(?:\[\w+\])?)*)", decl)
        if not m:
            raise ParseError("line %d: struct %s: cannot read the field %r" % (no, name, decl))
        type_text = m.group(1)
        for d in m.group(2).split(","):
            fm = re.fullmatch(r"(\w+) ?(?:\[(\w+)\])?", d.strip())
            base, depth, const = parse_type(type_text, header, no, "%s.%s" % (name, fm.group(1)))
            t = ctype(base, depth, const, header, no, "%s.%s" % (name, fm.group(1)))
            if fm.group(2):
                size = fm.group(2)
                if size in consts:
                    n = consts[size]
                elif re.fullmatch(r"[0-9]+", size):
                    n = int(size)
                else:
                    raise ParseError("line %d: %s.%s: unknown array size %r" % (no, name, fm.group(1), size))
                t = "%s * %d" % (t, n)
                cdecl = "%s %s[%s]" % (type_text.strip(), fm.group(1), size)
            else:
                cdecl = "%s %s" % (type_text.strip(), fm.group(1))
            fields.append((fm.group(1), t, cdecl))
    if not fields:
        raise ParseError("line %d: struct %s has no fields" % (no, name))
    header.structs.append((name, fields))


def parse_function(stmt, header, no):
    m = re.fullmatch(r"KVSHADE_API ([\w\s\*]+?) ?\b(kvshade_\w+) ?\((.*)\)", stmt)
    if not m or "(" in m.group(3) or ")" in m.group(3):
        raise ParseError("line %d: cannot read the function declaration %r" % (no, stmt))
    ret_text, name, params_text = m.group(1), m.group(2), m.group(3).strip()
    base, depth, const = parse_type(ret_text, header, no, name + " return")
    restype = ctype(base, depth, const, header, no, name + " return", ret=True)
    params = []
    if params_text != "void":
        if not params_text:
            raise ParseError("line %d: %s(): write (void)" % (no, name))
        for p in params_text.split(","):
            pm = re.fullmatch(r"(.*?[\s\*])(\w+)", p.strip())
            if not pm or pm.group(2) in ("const", "void") or pm.group(2) in SCALARS:
                raise ParseError("line %d: %s: a parameter without a name: %r" % (no, name, p.strip()))
            pbase, pdepth, pconst = parse_type(pm.group(1), header, no, "%s(%s)" % (name, pm.group(2)))
            params.append((pm.group(2), ctype(pbase, pdepth, pconst, header, no, "%s(%s)" % (name, pm.group(2))),
                           pm.group(1).strip()))
    if name in (f[0] for f in header.functions):
        raise ParseError("line %d: %s declared twice" % (no, name))
    header.functions.append((name, (restype, ret_text.strip()), params))


def parse(text):
    header = Header()
    for no, stmt in statements(preprocess(strip_comments(text), header)):
        m = re.fullmatch(r"typedef struct (kvshade_\w+) (kvshade_\w+)", stmt)
        if m:
            if m.group(1) != m.group(2):
                raise ParseError("line %d: typedef struct %s %s: the names differ" % (no, m.group(1), m.group(2)))
            header.opaque.add(m.group(1))
            continue
        m = re.fullmatch(r"typedef struct (kvshade_\w+) ?\{(.*)\} ?(kvshade_\w+)", stmt)
        if m:
            if m.group(1) != m.group(3):
                raise ParseError("line %d: typedef struct %s {...} %s: the names differ"
                                 % (no, m.group(1), m.group(3)))
            if m.group(1) in header.opaque:
                raise ParseError("line %d: struct %s is also declared opaque" % (no, m.group(1)))
            parse_struct(m.group(1), m.group(2), header, no)
            continue
        m = re.fullmatch(r"(?:typedef )?enum (?:(kvshade_\w+) )?\{(.*)\}(?: ?(kvshade_\w+))?", stmt)
        if m:
            if m.group(1) != m.group(3):
                raise ParseError("line %d: enum %s {...} %s: the names differ" % (no, m.group(1), m.group(3)))
            parse_enum(m.group(2), header, no)
            continue
        if stmt.startswith("KVSHADE_API "):
            parse_function(stmt, header, no)
            continue
        raise ParseError("line %d: a declaration this generator does not know: %r" % (no, stmt))
    header.constants.sort(key=lambda c: c[0])  # #defines were taken first
    names = [c[1] for c in header.constants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ParseError("constants defined twice: %s" % ", ".join(dup))
    if not header.functions:
        raise ParseError("no KVSHADE_API function found")
    return header


def render(header, header_path):
    rel = os.path.relpath(os.path.abspath(header_path), ROOT)
    if rel.startswith(".."):
        rel = header_path
    out = [
        "# Generated by scripts/gen_native.py from %s; do not edit." % rel,
        "# Regenerate: make native (or /usr/bin/python3 scripts/gen_native.py).",
        '"""The C ABI of kvshade.h for ctypes: its constants, its structs and the restype and',
        "argtypes of each function (SIGNATURES). kvshade._native loads the library with them.",
        '"""',
        "import ctypes",
        "",
    ]
    for _, name, value in header.constants:
        out.append("%s = %s" % (name, hex(value) if value > 0xFFFF else value))
    for name, fields in header.structs:
        out += ["", "", "class %s(ctypes.Structure):" % py_name(name), '    """%s"""' % name, "    _fields_ = ["]
        for fname, t, cdecl in fields:
            out.append("        (\"%s\", %s),  # %s" % (fname, t, cdecl))
        out.append("    ]")
    out += ["", "", "# C struct -> its ctypes.Structure.", "STRUCTS = {"]
    for name, _ in header.structs:
        out.append("    \"%s\": %s," % (name, py_name(name)))
    out += ["}", "", "# Function -> (restype, argtypes), in the header's order.", "SIGNATURES = {"]
    for name, (restype, ret_c), params in header.functions:
        out.append("    \"%s\": (%s, [  # returns %s" % (name, restype, ret_c))
        for pname, t, cdecl in params:
            out.append("        %s,  # %s %s" % (t, cdecl, pname))
        out.append("    ]),")
    out.append("}")
    return "\n".join(out) + "\n"


def generate(header_path=HEADER):
    with open(header_path) as f:
        text = f.read()
    try:
        return render(parse(text), header_path)
    except ParseError as e:
        raise SystemExit("%s: %s" % (header_path, e))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--header", default=HEADER)
    ap.add_argument("-o", "--output", default=OUTPUT)
    ap.add_argument("--check", action="store_true", help="exit 1 (with a diff) if --output differs")
    args = ap.parse_args(argv)
    text = generate(args.header)
    if args.check:
        try:
            with open(args.output) as f:
                old = f.read()
        except FileNotFoundError:
            old = ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       args.output, "generated from " + args.header))
            print("%s is stale: run /usr/bin/python3 scripts/gen_native.py" % args.output, file=sys.stderr)
            return 1
        return 0
    with open(args.output, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
