"""Datasets for the `embed_dataset` tests: writing one (Parquet, JSONL or CSV) to a local
directory or an S3 prefix, and reading back what gpulane wrote under an output prefix,
with the checks every output must pass.

Texts are the MiniLM fixture's texts, cut short and taken in turn, with the row number
appended so no two rows are the same text (a vector mixed up between rows shows)."""

import collections
import csv
import io
import json
import pathlib
import re

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import load_reference

PART = re.compile(r"^part-(\d{9})-(\d{9})\.parquet$")
METADATA_KEYS = ("gpulane.model", "gpulane.revision", "gpulane.dtype", "gpulane.family", "gpulane.source")

_FIXTURE_TEXTS = None


def fixture_texts() -> list:
    global _FIXTURE_TEXTS
    if _FIXTURE_TEXTS is None:
        _FIXTURE_TEXTS = load_reference("minilm")["texts"]
    return _FIXTURE_TEXTS


def texts(n: int, max_chars: int = 40, full_first: int = 0) -> list:
    """n distinct texts of varied length: fixture text i % 24, cut at max_chars (the first
    `full_first` rows uncut: unicode, tabs and newlines, 3,600 characters, empty), then
    " #<row>"."""
    base = fixture_texts()
    out = []
    for i in range(n):
        t = base[i % len(base)]
        if i >= full_first and max_chars is not None:
            t = t[:max_chars]
        out.append(f"{t} #{i}")
    return out


def make_ids(n: int, kind="int") -> list:
    """Row ids: "int" (0..n-1), "str" ("doc-000000017"...), or a given list."""
    if kind == "int":
        return list(range(n))
    if kind == "str":
        return [f"doc-{i:09d}" for i in range(n)]
    ids = list(kind)
    assert len(ids) == n, (len(ids), n)
    return ids


class Dataset:
    """What was written: its URI and its rows."""

    def __init__(self, uri, ids, texts):
        self.uri = uri
        self.ids = ids
        self.texts = texts
        self.text_of = dict(zip(ids, texts))

    def __len__(self):
        return len(self.ids)


def encode(fmt: str, ids: list, texts: list, id_column="id", text_column="text",
           row_group_size=None, extra_columns=None) -> bytes:
    """The bytes of a dataset file. Parquet ids are int64 when they are ints, else strings."""
    columns = {id_column: ids, text_column: texts, **(extra_columns or {})}
    if fmt == "parquet":
        id_type = pa.int64() if all(isinstance(i, int) for i in ids) else pa.string()
        arrays, names = [], []
        for name, values in columns.items():
            t = id_type if name == id_column else (pa.string() if name == text_column else None)
            arrays.append(pa.array(values, type=t))
            names.append(name)
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_arrays(arrays, names=names), buf,
                       row_group_size=row_group_size or 4096)
        return buf.getvalue()
    if fmt == "jsonl":
        rows = (dict(zip(columns, values)) for values in zip(*columns.values()))
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(list(columns))
        w.writerows(zip(*columns.values()))
        return buf.getvalue().encode()
    raise ValueError(fmt)


class Local:
    """A directory, seen as file:// URIs (the root URI ends with /)."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = self.root.as_uri() + "/"

    def uri(self, rel: str = "") -> str:
        return self.root_uri + rel

    def put(self, rel: str, data: bytes) -> str:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return self.uri(rel)

    def get(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def list(self, rel_prefix: str = "") -> list:
        """Every file (and symlink) under root whose relative name starts with rel_prefix."""
        out = []
        for p in self.root.rglob("*"):
            if p.is_file() or p.is_symlink():
                name = p.relative_to(self.root).as_posix()
                if name.startswith(rel_prefix):
                    out.append(name)
        return sorted(out)


class S3Prefix:
    """A key prefix in the test bucket, seen as s3:// URIs (the root URI ends with /)."""

    def __init__(self, s3, prefix: str):
        assert prefix.endswith("/"), prefix
        self.s3 = s3
        self.prefix = prefix
        self.root_uri = s3.uri(prefix)

    def uri(self, rel: str = "") -> str:
        return self.root_uri + rel

    def put(self, rel: str, data: bytes) -> str:
        self.s3.client.put_object(Bucket=self.s3.bucket, Key=self.prefix + rel, Body=data)
        return self.uri(rel)

    def get(self, rel: str) -> bytes:
        return self.s3.client.get_object(Bucket=self.s3.bucket, Key=self.prefix + rel)["Body"].read()

    def list(self, rel_prefix: str = "") -> list:
        return [k[len(self.prefix):] for k in self.s3.keys(self.prefix + rel_prefix)]


def write_dataset(loc, rel: str, n: int, fmt: str = None, ids="int", max_chars: int = 40,
                  full_first: int = 0, **encode_options) -> Dataset:
    """Writes n rows to loc/rel (format from the extension unless given)."""
    fmt = fmt or rel.rsplit(".", 1)[-1]
    row_ids = make_ids(n, ids)
    row_texts = texts(n, max_chars=max_chars, full_first=full_first)
    uri = loc.put(rel, encode(fmt, row_ids, row_texts, **encode_options))
    return Dataset(uri, row_ids, row_texts)


class Output:
    """Every part file under an output prefix, read and checked: the Parquet schema, the
    metadata keys, each part's rows matching the range in its name, every id once."""

    def __init__(self, loc, out_rel: str, dimensions: int = 384):
        assert out_rel.endswith("/"), out_rel
        self.names = loc.list(out_rel)
        rel_names = [n[len(out_rel):] for n in self.names]
        self.part_names = sorted(n for n in rel_names if PART.match(n))
        self.manifest_names = sorted(n for n in rel_names if re.match(r"^_manifest(-\d{9}-\d{9})?\.json$", n))
        # Anything else under the prefix (temporary files, parts in sub-folders) is news.
        self.others = sorted(set(rel_names) - set(self.part_names) - set(self.manifest_names))
        self.manifests = {n: json.loads(loc.get(out_rel + n)) for n in self.manifest_names}
        self.ranges = []
        self.metadata = []
        tables = []
        for name in self.part_names:
            start, end = map(int, PART.match(name).groups())
            f = pq.ParquetFile(pa.BufferReader(loc.get(out_rel + name)))
            t = f.read()
            check_part_schema(t.schema, dimensions, name)
            assert t.num_rows == end - start, (name, t.num_rows)
            # The file's key-value metadata (pyarrow's schema.metadata shows only what the
            # embedded Arrow schema carries, when the writer stored one).
            meta = {k.decode(): v.decode() for k, v in (f.metadata.metadata or {}).items()}
            for key in METADATA_KEYS:
                assert key in meta, (name, key, sorted(meta))
            self.metadata.append(meta)
            self.ranges.append((start, end))
            tables.append(t.select(["id", "embedding", "tokens"]).replace_schema_metadata(None))
        # Ranges never overlap (parts of shards that write to one prefix tile it).
        for (s0, e0), (s1, e1) in zip(self.ranges, self.ranges[1:]):
            assert e0 <= s1, ("overlapping parts", (s0, e0), (s1, e1))
        self.dimensions = dimensions
        if tables:
            types = {t.schema.field("id").type for t in tables}
            assert len(types) == 1, ("id types differ between parts", types)
            self.id_type = types.pop()
            self.table = pa.concat_tables(tables)
        else:
            self.id_type = None
            self.table = pa.table({"id": pa.array([], pa.int64()),
                                   "embedding": pa.array([], pa.list_(pa.float32(), dimensions)),
                                   "tokens": pa.array([], pa.int32())})
        self.ids = self.table.column("id").to_pylist()
        counts = collections.Counter(self.ids)
        dups = [i for i, c in counts.items() if c > 1]
        assert not dups, f"{len(dups)} ids written more than once, e.g. {dups[:5]}"
        self.row_of = {i: r for r, i in enumerate(self.ids)}
        self._values = self.table.column("embedding").combine_chunks().flatten()
        self._tokens = self.table.column("tokens")

    def __len__(self):
        return len(self.ids)

    def vector(self, row_id) -> list:
        r = self.row_of[row_id]
        d = self.dimensions
        return self._values.slice(r * d, d).to_pylist()

    def tokens(self, row_id) -> int:
        return self._tokens[self.row_of[row_id]].as_py()

    def rows_by_part(self, loc, out_rel) -> dict:
        """{part name: set of its ids} (re-reads the parts; for range checks)."""
        out = {}
        for name in self.part_names:
            t = pq.read_table(pa.BufferReader(loc.get(out_rel + name)), columns=["id"])
            out[name] = set(t.column("id").to_pylist())
        return out

    def check_complete(self, dataset: Dataset, loc=None, out_rel=None):
        """Every row of the dataset once, nothing else; with loc, each part holds exactly the
        rows of the range its name gives."""
        assert len(self.ids) == len(dataset.ids), (len(self.ids), len(dataset.ids))
        missing = set(dataset.ids) - set(self.row_of)
        assert not missing, f"{len(missing)} ids missing, e.g. {sorted(missing, key=str)[:5]}"
        if loc is not None:
            for name, got in self.rows_by_part(loc, out_rel).items():
                start, end = map(int, PART.match(name).groups())
                assert got == set(dataset.ids[start:end]), (name, "holds rows outside its range")


def check_part_schema(schema: pa.Schema, dimensions: int, name: str = ""):
    id_type = schema.field("id").type
    assert id_type in (pa.int64(), pa.string(), pa.large_string()), (name, "id", id_type)
    emb = schema.field("embedding").type
    assert pa.types.is_fixed_size_list(emb), (name, "embedding is not a fixed-size list", emb)
    assert emb.list_size == dimensions, (name, emb.list_size, dimensions)
    assert emb.value_type == pa.float32(), (name, emb.value_type)
    assert schema.field("tokens").type == pa.int32(), (name, schema.field("tokens").type)
