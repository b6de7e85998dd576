package layout_test

import (
	"os"
	"regexp"
	"testing"
)

// TestPageKeyVectorDocumented: the test vector that docs/format/page.md
// gives for writers of an independent reader is the one TestPageKeyVector
// checks against a hand computation, identity and page size included.
func TestPageKeyVectorDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/format/page.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	for _, want := range []struct{ label, hex string }{
		{"k_0", vecK0}, {"k_1", vecK1}, {"k_2", vecK2}, {"leaf", vecLeaf},
	} {
		re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(want.label) + ` *= ([0-9a-f]{64})`)
		m := re.FindStringSubmatch(text)
		if m == nil {
			t.Errorf("docs/format/page.md has no line %q", want.label+" = <64 hex>")
			continue
		}
		if m[1] != want.hex {
			t.Errorf("docs/format/page.md: %s = %s, want %s", want.label, m[1], want.hex)
		}
	}
	if !regexp.MustCompile("identity\\s+`" + regexp.QuoteMeta(vecIdentity) + "`").MatchString(text) {
		t.Errorf("docs/format/page.md does not give the vector's identity %q", vecIdentity)
	}
	if !regexp.MustCompile("`P` = 16,").MatchString(text) || vecP != 16 {
		t.Errorf("docs/format/page.md does not give the vector's P = %d", vecP)
	}
}
