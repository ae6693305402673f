package iptables

import (
	"fmt"
	"os/exec"
	"strings"

	goipt "github.com/coreos/go-iptables/iptables"
	"github.com/hashicorp/go-multierror"
	"github.com/sirupsen/logrus"
)

// Cleanup removes every jump, rule and chain the daemon installs, for IPv4
// and IPv6. A family whose tools are missing is skipped; running it twice is
// harmless.
func Cleanup(log logrus.FieldLogger) error {
	var errs *multierror.Error
	for _, proto := range []goipt.Protocol{goipt.ProtocolIPv4, goipt.ProtocolIPv6} {
		bin := "iptables"
		if proto == goipt.ProtocolIPv6 {
			bin = "ip6tables"
		}
		if _, err := exec.LookPath(bin); err != nil {
			log.WithField("binary", bin).Info("Not installed; nothing to clean")
			continue
		}
		ipt, err := goipt.New(goipt.IPFamily(proto), goipt.Timeout(30))
		if err != nil {
			errs = multierror.Append(errs, fmt.Errorf("%s: %w", bin, err))
			continue
		}
		n, err := cleanupFamily(ipt, bin+"-restore")
		if err != nil {
			errs = multierror.Append(errs, fmt.Errorf("%s: %w", bin, err))
		}
		log.WithFields(logrus.Fields{"binary": bin, "removed": n}).Info("Cleaned up")
	}
	return errs.ErrorOrNil()
}

func cleanupFamily(ipt *goipt.IPTables, restore string) (int, error) {
	removed := 0
	var errs *multierror.Error
	doomed := map[string][]string{}
	for _, table := range []string{"nat", "filter"} {
		// Our chains are found by name: the trees' chains depend on the
		// Services the daemon last served.
		all, err := ipt.ListChains(table)
		if err != nil {
			continue // the table does not exist: nothing of ours in it
		}
		// Jumps first: a chain that is still referenced cannot be deleted.
		// A jump that cannot be deleted does not stop the rest.
		n, err := deleteJumps(ipt, table, nil)
		removed += n
		if err != nil {
			errs = multierror.Append(errs, err)
		}
		for _, c := range all {
			if isOurs(table, c) {
				doomed[table] = append(doomed[table], c)
			}
		}
	}
	n := len(doomed["nat"]) + len(doomed["filter"])
	if n == 0 {
		return removed, errs.ErrorOrNil()
	}
	// One restore flushes and deletes them all: a chain at a time would be
	// two iptables runs each, for hundreds of tree chains.
	cmd := exec.Command(restore, "-w", "--noflush")
	cmd.Stdin = strings.NewReader(deleteChainsInput(doomed))
	if _, err := cmd.CombinedOutput(); err == nil {
		return removed + n, errs.ErrorOrNil()
	}
	// The transaction failed as a whole (a chain of someone else's jumps
	// to one of ours, say): remove what can be removed, one chain at a
	// time, and name what cannot.
	for table, chains := range doomed {
		for _, c := range chains {
			if err := ipt.ClearChain(table, c); err != nil {
				errs = multierror.Append(errs, fmt.Errorf("flushing %s %s: %w", table, c, err))
			}
		}
	}
	for table, chains := range doomed {
		for _, c := range chains {
			if err := ipt.DeleteChain(table, c); err != nil {
				errs = multierror.Append(errs, fmt.Errorf("deleting %s %s (still referenced?): %w", table, c, err))
				continue
			}
			removed++
		}
	}
	return removed, errs.ErrorOrNil()
}

// target returns the chain a rule jumps to.
func target(args []string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-j" || args[i] == "--jump" {
			return args[i+1]
		}
	}
	return ""
}

// splitRule splits an iptables -S line into arguments, honouring the double
// quotes iptables puts around comments.
func splitRule(line string) []string {
	var out []string
	var cur strings.Builder
	inQuote, have := false, false
	for i := 0; i < len(line); i++ {
		ch := line[i]
		switch {
		case ch == '\\' && inQuote && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case ch == '"':
			inQuote, have = !inQuote, true
		case ch == ' ' && !inQuote:
			if have {
				out = append(out, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(ch)
			have = true
		}
	}
	if have {
		out = append(out, cur.String())
	}
	return out
}
