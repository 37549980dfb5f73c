// Lints Python files with Ruff's official WebAssembly build, using the repository's
// ruff.toml. Usage: node scripts/ruff/check.mjs PATH... (files or folders, walked for *.py).
// Prints one line per finding (path:row:col: CODE message) and exits 1 if there is any,
// 2 on a usage or setup error. Install its two packages first: npm ci --prefix scripts/ruff.
import { readFileSync, readdirSync, statSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..", "..");
let Workspace, PositionEncoding, parse;
try {
  ({ Workspace, PositionEncoding } = await import("@astral-sh/ruff-wasm-nodejs"));
  ({ parse } = await import("smol-toml"));
} catch (e) {
  console.error(`ruff: ${e.message}\nruff: run \`npm ci --prefix scripts/ruff\` first`);
  process.exit(2);
}

const args = process.argv.slice(2);
if (args.length === 0) {
  console.error("usage: node scripts/ruff/check.mjs PATH...");
  process.exit(2);
}

const settings = parse(readFileSync(join(root, "ruff.toml"), "utf8"));
const workspace = new Workspace(settings, PositionEncoding.Utf32);

// Folders Ruff itself skips by default, and installed or generated trees.
const skipped = new Set([".git", "__pycache__", "node_modules", ".mypy_cache", "build", ".venv"]);
function pythonFiles(path, out) {
  const st = statSync(path);  // a missing path throws: a typo must not lint nothing
  if (st.isFile()) {
    if (path.endsWith(".py")) out.push(path);
  } else if (st.isDirectory()) {
    for (const name of readdirSync(path).sort()) {
      if (!skipped.has(name)) pythonFiles(join(path, name), out);
    }
  }
  return out;
}

let files;
try {
  files = args.flatMap((a) => pythonFiles(resolve(a), []));
} catch (e) {
  console.error(`ruff: ${e.message}`);
  process.exit(2);
}
let findings = 0;
for (const file of files) {
  const name = relative(process.cwd(), file);
  const found = workspace.check(readFileSync(file, "utf8"));
  found.sort((a, b) => a.start_location.row - b.start_location.row || a.start_location.column - b.start_location.column);
  for (const d of found) {
    const { row, column } = d.start_location;
    console.log(`${name}:${row}:${column}: ${d.code ?? "syntax-error"} ${d.message}`);
    findings += 1;
  }
}
console.log(`ruff ${Workspace.version()}: ${files.length} files, ${findings} finding${findings === 1 ? "" : "s"}`);
process.exit(findings > 0 ? 1 : 0);
