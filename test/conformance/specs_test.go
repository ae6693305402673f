package main

import (
	"reflect"
	"testing"
)

func TestSpecSetDiff(t *testing.T) {
	for _, tc := range []struct {
		name      string
		want, got []string
		diff      []string
	}{
		{"equal, any order", []string{"a", "b"}, []string{"b", "a"}, nil},
		{"a spec the lab's binary lost", []string{"a", "b"}, []string{"a"}, []string{"missing from the lab's binary: b"}},
		{"a spec only the lab's binary has", []string{"a"}, []string{"a", "c"}, []string{"only in the lab's binary: c"}},
		{"both", []string{"a", "b"}, []string{"a", "c"}, []string{"missing from the lab's binary: b", "only in the lab's binary: c"}},
		{"upstream lists none", nil, []string{"a"}, []string{"only in the lab's binary: a"}},
	} {
		if got := specSetDiff(tc.want, tc.got); !reflect.DeepEqual(got, tc.diff) {
			t.Errorf("%s: specSetDiff(%q, %q) = %q, want %q", tc.name, tc.want, tc.got, got, tc.diff)
		}
	}
}

func TestReadSpecList(t *testing.T) {
	text := "# header\n# focus: x\n[sig-network] Services should a\n\n  [sig-network] Services should b  \n"
	want := []string{"[sig-network] Services should a", "[sig-network] Services should b"}
	if got := readSpecList(text); !reflect.DeepEqual(got, want) {
		t.Errorf("readSpecList = %q, want %q", got, want)
	}
}
