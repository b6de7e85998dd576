package layout_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
	"github.com/zeebo/xxh3"
)

// richHeader is baseHeader with nested caller metadata at the top, entry and
// tensor level, every value in compact form.
func richHeader() *layout.Header {
	h := baseHeader()
	h.Meta = layout.Meta{
		"model":  json.RawMessage(`"llama-3.1-8b"`),
		"nested": json.RawMessage(`{"a":[1,2.5,{"b":null,"c":[true,false]}],"s":"x\u00e9\"q","e":{}}`),
		"ids":    json.RawMessage(`[128000,9906,1917]`),
		"zeta":   json.RawMessage(`-1e-9`),
	}
	h.Caches[1].Meta["extra"] = json.RawMessage(`{"rope":{"theta":500000,"scaling":[8,1,4]}}`)
	h.Caches[0].Tensors[1].Meta = layout.Meta{
		"scale": json.RawMessage(`0.125`),
		"quant": json.RawMessage(`{"bits":4,"group":[64,{"k":"v"}]}`),
	}
	h.Attachments[0].Tensors[0].Meta = layout.Meta{"vocab": json.RawMessage(`"llama3"`)}
	return h
}

func TestHeaderRoundTripWithMetadata(t *testing.T) {
	for _, kind := range []string{"single", "blocks"} {
		t.Run(kind, func(t *testing.T) {
			h := richHeader()
			var file []byte
			if kind == "blocks" {
				toBlocks(h)
				file = manifestFile(t, h)
			} else {
				file = singleFile(t, h)
			}
			snap, _, err := decodeBytes(t, file)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(snap.Header, h) {
				t.Fatalf("decoded header differs:\n got %+v\nwant %+v", snap.Header, h)
			}
			// Every metadata value comes back byte for byte.
			for k, v := range h.Meta {
				if !bytes.Equal(snap.Header.Meta[k], v) {
					t.Errorf("top-level %q = %s, want %s", k, snap.Header.Meta[k], v)
				}
			}
			if got := snap.Header.Caches[0].Tensors[1].Meta["quant"]; string(got) != `{"bits":4,"group":[64,{"k":"v"}]}` {
				t.Errorf("tensor metadata quant = %s", got)
			}
			if got := snap.Header.Caches[1].Meta["extra"]; string(got) != `{"rope":{"theta":500000,"scaling":[8,1,4]}}` {
				t.Errorf("entry metadata extra = %s", got)
			}
			// Re-encoding the decoded header reproduces the stored JSON.
			js, err := snap.Header.Encode()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(js, snap.JSON) {
				t.Fatalf("re-encoded JSON differs:\n got %s\nwant %s", js, snap.JSON)
			}
			if int(snap.HeaderLen) != len(js) || snap.Legacy {
				t.Fatalf("prefix %+v for %d bytes of JSON", snap.Prefix, len(js))
			}
			// The stored JSON is valid and holds the values in place.
			var generic map[string]any
			if err := json.Unmarshal(snap.JSON, &generic); err != nil {
				t.Fatalf("stored JSON invalid: %v", err)
			}
			nested := generic["nested"].(map[string]any)
			if nested["s"] != "xé\"q" {
				t.Errorf("nested.s = %q", nested["s"])
			}
		})
	}
}

// TestUnknownFieldsPreservedBytewise decodes hand-written JSON whose unknown
// keys sit before, between and after the known ones: each unknown value is
// kept with its exact bytes (whitespace inside included).
func TestUnknownFieldsPreservedBytewise(t *testing.T) {
	data := tensorData(0, 16)
	js := `{"zz":{"deep":[1, 2,{"x" : "y"}]},"caches":[{"first":[0],"tensors":[{"pre":"a b","off":0,"bytes":16,"mid":{"k":[]},"hash":"` +
		hashOf(data) + `","dtype":"uint8","shape":[16],"post":1.50}],"last":null}],"formatVersion":4,"aa":"\u0041"}`
	ds := layout.DataAlign
	file := make([]byte, ds+16)
	copy(file, prefix([]byte(js), uint32(ds)))
	copy(file[26:], js)
	copy(file[ds:], data)
	snap, _, err := decodeBytes(t, file)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	want := map[string]string{"zz": `{"deep":[1, 2,{"x" : "y"}]}`, "aa": `"\u0041"`}
	if len(snap.Header.Meta) != len(want) {
		t.Fatalf("top-level meta %v", snap.Header.Meta)
	}
	for k, v := range want {
		if string(snap.Header.Meta[k]) != v {
			t.Errorf("top %q = %s, want %s", k, snap.Header.Meta[k], v)
		}
	}
	e := snap.Header.Caches[0]
	if string(e.Meta["first"]) != `[0]` || string(e.Meta["last"]) != `null` || len(e.Meta) != 2 {
		t.Errorf("entry meta %v", e.Meta)
	}
	tm := e.Tensors[0].Meta
	if string(tm["pre"]) != `"a b"` || string(tm["mid"]) != `{"k":[]}` || string(tm["post"]) != `1.50` || len(tm) != 3 {
		t.Errorf("tensor meta %v", tm)
	}
	if e.Tensors[0].Bytes != 16 || e.Tensors[0].DType != "uint8" || snap.Header.FormatVersion != 4 {
		t.Errorf("known fields %+v", e.Tensors[0])
	}
}

func TestEncodeRejectsBadMetadata(t *testing.T) {
	cases := []struct {
		name string
		mut  func(h *layout.Header)
		want string
	}{
		{"top reserved caches", func(h *layout.Header) { h.Meta["caches"] = json.RawMessage(`[]`) }, `"caches"`},
		{"top reserved formatVersion", func(h *layout.Header) { h.Meta["formatVersion"] = json.RawMessage(`4`) }, `"formatVersion"`},
		{"entry reserved tensors", func(h *layout.Header) { h.Caches[1].Meta["tensors"] = json.RawMessage(`[]`) }, `caches[1]`},
		{"tensor reserved hash", func(h *layout.Header) { h.Attachments[0].Tensors[0].Meta["hash"] = json.RawMessage(`"x"`) }, `attachments[0].tensors[0]`},
		{"invalid JSON top", func(h *layout.Header) { h.Meta["bad"] = json.RawMessage(`{"a":`) }, `"bad"`},
		{"invalid JSON tensor", func(h *layout.Header) { h.Caches[0].Tensors[1].Meta["bad"] = json.RawMessage(`nope`) }, `caches[0].tensors[1]`},
		{"duplicate key in a metadata value", func(h *layout.Header) {
			h.Caches[0].Meta["cfg"] = json.RawMessage(`[{"rope":1,"r\u006fpe":2}]`)
		}, `"rope" twice`},
		{"metadata key not UTF-8", func(h *layout.Header) { h.Meta["a\xff"] = json.RawMessage(`1`) }, `not valid UTF-8`},
		{"keys of a metadata value equal once decoded as UTF-8", func(h *layout.Header) {
			h.Meta["cfg"] = json.RawMessage("{\"r\xff\":1,\"r\xfe\":2}")
		}, "\"r\ufffd\" twice"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := baseHeader()
			c.mut(h)
			_, err := h.Encode()
			if !errors.Is(err, layout.ErrInvalidHeader) {
				t.Fatalf("Encode error %v, want ErrInvalidHeader", err)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not name %s", err, c.want)
			}
		})
	}
}

func TestEncodeCompactsMetadataDeterministically(t *testing.T) {
	h := baseHeader()
	h.Meta = layout.Meta{"b": json.RawMessage("{ \"x\" : [ 1 , 2 ] }"), "a": json.RawMessage(" 7 ")}
	js, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(js, []byte(`{"a":7,"b":{"x":[1,2]},"caches":[`)) {
		t.Fatalf("JSON starts %s", js[:min(len(js), 60)])
	}
	if !bytes.HasSuffix(js, []byte(`,"formatVersion":4}`)) {
		t.Fatalf("JSON ends %s", js[max(0, len(js)-40):])
	}
	js2, _ := h.Clone().Encode()
	if !bytes.Equal(js, js2) {
		t.Fatal("Encode is not deterministic")
	}
}

func TestHeaderHashAndPrefixMatchSpec(t *testing.T) {
	js := []byte(`{"caches":[]}`)
	const ds = 16384
	var msg []byte
	msg = binary.LittleEndian.AppendUint32(msg, uint32(len(js)))
	msg = binary.LittleEndian.AppendUint32(msg, ds)
	msg = append(msg, js...)
	if got, want := layout.HeaderHash(uint32(len(js)), ds, js), xxh3.Hash(msg); got != want {
		t.Fatalf("HeaderHash %016x, want %016x", got, want)
	}
	buf := layout.EncodePrefix(js, ds)
	if len(buf) != ds {
		t.Fatalf("EncodePrefix length %d, want %d", len(buf), ds)
	}
	if !bytes.Equal(buf[:26], prefix(js, ds)) || !bytes.Equal(buf[26:26+len(js)], js) {
		t.Fatalf("prefix %x differs from the spec's %x", buf[:26], prefix(js, ds))
	}
	if bytes.Count(buf[26+len(js):], []byte{0}) != ds-26-len(js) {
		t.Fatal("padding after the JSON is not zero")
	}
	if got := layout.TensorHash(0x00ab_0000_0000_00cd); got != "00ab0000000000cd" {
		t.Fatalf("TensorHash = %q", got)
	}
	if got := layout.HashValue("00ab0000000000cd"); got != 0x00ab_0000_0000_00cd {
		t.Fatalf("HashValue = %#x", got)
	}
	p, err := layout.ParsePrefix(buf)
	if err != nil || p.HeaderLen != uint32(len(js)) || p.DataStart != ds || p.HeaderHash != xxh3.Hash(msg) || p.Legacy {
		t.Fatalf("ParsePrefix = %+v, %v", p, err)
	}
}

func TestItemSizeAndLayoutNames(t *testing.T) {
	for dt, n := range map[string]int{"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int8": 1, "bool": 1, "float64": 8, "complex64": 8} {
		if got, err := layout.ItemSize(dt); err != nil || got != n {
			t.Errorf("ItemSize(%q) = %d, %v; want %d", dt, got, err, n)
		}
	}
	for _, dt := range []string{"", "bf16", "float8", "BFLOAT16"} {
		if _, err := layout.ItemSize(dt); !errors.Is(err, layout.ErrUnknownDType) {
			t.Errorf("ItemSize(%q) error %v, want ErrUnknownDType", dt, err)
		}
	}
	for _, l := range []layout.Layout{layout.Single, layout.Blocks} {
		got, err := layout.ParseLayout(l.String())
		if err != nil || got != l {
			t.Errorf("ParseLayout(%q) = %v, %v", l.String(), got, err)
		}
	}
	if _, err := layout.ParseLayout("Single"); err == nil {
		t.Error(`ParseLayout("Single") succeeded`)
	}
}
