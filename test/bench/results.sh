# Shared by bench.sh and nodetax.sh: figures recorded as "metric key value"
# lines in $results, read back as the median over runs.
record() { echo "$1 $2 $3" >>"$results"; } # metric key value
jsonval() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; } # a number from loadgen's JSON on stdin
median() { sort -g | awk '{v[NR]=$1} END{if(NR==0){print "—"}else{print v[int((NR+1)/2)]}}'; }
value() { awk -v m="$1" -v p="$2" '$1==m && $2==p {print $3}' "$results" | median; } # metric key → median
