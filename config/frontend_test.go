package config

import "testing"

func TestParsePortRange(t *testing.T) {
	for in, want := range map[string]PortRange{
		"": {}, "0-0": {}, "30000-30009": {Base: 30000, Size: 10}, "30000+9": {Base: 30000, Size: 10}, "8080": {Base: 8080, Size: 1},
	} {
		got, err := ParsePortRange(in)
		if err != nil || got != want {
			t.Errorf("ParsePortRange(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"a-b", "10-5", "0-70000", "-5", "1+x"} {
		if _, err := ParsePortRange(bad); err == nil {
			t.Errorf("ParsePortRange(%q) accepted", bad)
		}
	}
}
