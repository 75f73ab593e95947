import pytest

from shardfleet import schema as sch
from shardfleet.errors import SchemaError


def test_default_schema_registry():
    s = sch.default_schema()
    assert s.object_type("pin").type == 1
    assert s.object_type("board").type == 2
    assert s.object_type("user").type == 3
    assert s.object_type(4).name == "comment"
    assert s.object_type("like").table == "likes"
    for name in ("board_has_pins", "user_has_boards", "user_likes_pins", "pin_liked_by_user"):
        assert s.mapping(name).table == name
    for name in ("user_by_email", "user_by_external_id", "ip_data"):
        assert s.lookup(name).table == name
    with pytest.raises(SchemaError, match="unknown object type"):
        s.object_type("widget")


def test_ddl_shapes():
    ddl = sch.default_schema().ddl()
    pins = ddl["pins"]
    assert "local_id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT" in pins
    assert "body JSON NOT NULL" in pins and "TIMESTAMP" in pins
    assert "PRIMARY KEY (local_id)" in pins
    bhp = ddl["board_has_pins"]
    assert "PRIMARY KEY (from_id, to_id)" in bhp
    assert "KEY from_sequence (from_id, sequence)" in bhp
    for stmt in ddl.values():
        assert "ENGINE=InnoDB" in stmt and "CHARSET=utf8mb4" in stmt
    assert set(ddl) == set(sch.default_schema().tables)
    assert set(sch.default_schema().columns()) == set(ddl)


@pytest.mark.parametrize("doc,needle", [
    ("[", "does not parse"),
    ("- 1", "must be a mapping"),
    ("objects: []", "no object types"),
    ("objects: [{name: pin, type: 0}]", "not in 1..1023"),
    ("objects: [{name: pin, type: 1024}]", "not in 1..1023"),
    ("objects: [{name: Pin, type: 1}]", "not a valid name"),
    ("objects: [{name: 'pin; drop', type: 1}]", "not a valid name"),
    ("objects: [{name: pin, type: 1}, {name: pin, type: 2}]", "defined twice"),
    ("objects: [{name: pin, type: 1}]\nmappings: [{name: pinpins, from: pin, to: pin}]",
     "noun_verb_noun"),
    ("objects: [{name: pin, type: 1}]\nmappings: [{name: pin_has_x, from: pin, to: x}]",
     "not an object type"),
    ("objects: [{name: pin, type: 1}]\nlookups: [{name: by_x, value: blob}]", "value must be"),
])
def test_bad_schema_files(tmp_path, doc, needle):
    f = tmp_path / "schema.yml"
    f.write_text(doc)
    with pytest.raises(SchemaError, match=needle):
        sch.load_schema(f)


def test_missing_schema_file(tmp_path):
    with pytest.raises(SchemaError, match="cannot read"):
        sch.load_schema(tmp_path / "nope.yml")


def test_shard_database_names():
    assert sch.shard_database(0) == "db00000"
    assert sch.shard_database(4095) == "db04095"
    assert sch.shard_database(65535) == "db65535"
    for bad in (-1, 65536, "1", True):
        with pytest.raises(SchemaError):
            sch.shard_database(bad)
