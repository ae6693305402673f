// Package options is the daemon's configuration, as kube-proxy's
// app/options is its own: the flags (kube-proxy's names where one exists),
// the --config file (kube-proxy's KubeProxyConfiguration, every field
// applied or warned about) and what /configz shows. Parse reads them and
// checks the values against each other; an Options names where each value
// came from (Name), so that an error says --flag or the file's field.
//
// It owns nothing that runs; it imports config's plain data and the leaf
// packages whose types its values are (balance, clientaddr, dataplane's
// defaults).
package options
