package layout_test

import (
	"errors"
	"testing"

	"github.com/kvpersist/kvpersist/engine/layout"
)

// Every known field has the right JSON type (docs/format/single-file.md, "What a reader checks"):
// null for a known key and block keys in another case are refused as
// ErrInvalidHeader, although encoding/json alone would accept both.
func TestDecodeRefusesNullAndMiscasedKeys(t *testing.T) {
	blk := `"0000000000000000000000000000000000000000000000000000000000000000"`
	cases := map[string]string{
		"shape null (read as a scalar)": `{"caches":[{"tensors":[{"bytes":1,"dtype":"bool","shape":null,"blocks":[{"hash":` + blk + `,"bytes":1}]}]}],"formatVersion":5}`,
		"caches null":                   `{"caches":null,"formatVersion":5}`,
		"tensors null":                  `{"caches":[{"tensors":null}],"formatVersion":5}`,
		"bytes null":                    `{"caches":[{"tensors":[{"bytes":null,"dtype":"bool","shape":[0]}]}],"formatVersion":5}`,
		"block keys in upper case":      `{"caches":[{"tensors":[{"bytes":1,"dtype":"bool","shape":[1],"blocks":[{"HASH":` + blk + `,"BYTES":1}]}]}],"formatVersion":5}`,
	}
	for name, js := range cases {
		b := append(prefix([]byte(js), uint32(26+len(js))), js...)
		if _, _, err := decodeBytes(t, b); !errors.Is(err, layout.ErrInvalidHeader) {
			t.Errorf("%s: decoded (err %v), want ErrInvalidHeader", name, err)
		}
	}
}
